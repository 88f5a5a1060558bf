"""HTTP/2 on the wire, pure (RFC 9113, RFC 7541): frames, error codes, HPACK and Huffman coding, shared by the
client-facing codec (``proxy/listen/``) and the multiplexed upstream (``proxy/upstream/mux``)."""
