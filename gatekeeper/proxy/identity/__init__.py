"""Who the caller is, settled before flow control: certificate names, bearer tokens, trusted impersonation.

The pipeline's front stage uses it to set ``request.identity``; flow control only reads that, and its fleet
imports the ``Upstream`` protocol and header stamping from here, never from the pipeline."""
