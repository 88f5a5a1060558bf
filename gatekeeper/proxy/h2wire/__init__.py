"""HTTP/2 on the wire, pure: frame layouts, error codes, HPACK tables, encoding, decoding and Huffman coding
(RFC 9113, RFC 7541).

Shared by both of the proxy's HTTP/2 sides: the client-facing server codec
(``proxy/listen/``) and the multiplexed upstream client (``proxy/upstream/mux``).
Nothing here does I/O or knows which side it serves.
"""
