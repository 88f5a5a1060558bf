"""Our HPACK Huffman decoder against RFC 7541 and against ``hpack``'s decoder, and its memo's bounds.

``hpack.huffman_table.decode_huffman`` is the reference: every valid string
decodes to the same octets, every string it rejects we reject (and only
those), and a bad string in a header block costs the client the whole
connection (GOAWAY COMPRESSION_ERROR).
"""

from __future__ import annotations

import random

import hpack
import pytest
from hpack import NeverIndexedHeaderTuple
from hpack.exceptions import HPACKDecodingError
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.huffman_table import decode_huffman as reference
from test_h2_codec import Client
from test_h2_codec_hostile import _huffman_literal

from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.h2wire import huffman
from gatekeeper.proxy.h2wire.errors import ErrorCodes
from gatekeeper.proxy.h2wire.hpack_decode import BlockDecoder, HeaderBlockError
from gatekeeper.proxy.h2wire.hpack_encode import huffman_encode
from gatekeeper.proxy.h2wire.hpack_tables import HUFFMAN_CODES, HUFFMAN_LENGTHS
from gatekeeper.proxy.h2wire.huffman import HuffmanDecodingError, decode

encode = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH).encode

# RFC 7541 Appendix C.4 and C.6: Huffman-coded strings of the request and response examples.
APPENDIX_C = [
    ("f1e3 c2e5 f23a 6ba0 ab90 f4ff", b"www.example.com"),
    ("a8eb 1064 9cbf", b"no-cache"),
    ("25a8 49e9 5ba9 7d7f", b"custom-key"),
    ("25a8 49e9 5bb8 e8b4 bf", b"custom-value"),
    ("6402", b"302"),
    ("aec3 771a 4b", b"private"),
    ("d07a be94 1054 d444 a820 0595 040b 8166 e082 a62d 1bff", b"Mon, 21 Oct 2013 20:13:21 GMT"),
    ("9d29 ad17 1863 c78f 0b97 c8e9 ae82 ae43 d3", b"https://www.example.com"),
    ("640e ff", b"307"),
    ("d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff", b"Mon, 21 Oct 2013 20:13:22 GMT"),
    ("9bd9 ab", b"gzip"),
    ("94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f 9587 3160 65c0 03ed 4ee5 b106 3d50 07",
     b"foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"),
]


def _outcome(decoder, data: bytes) -> bytes | None:
    """What ``decoder`` makes of ``data``: the octets, or None if it rejects the string."""
    try:
        return decoder(data)
    except (HPACKDecodingError, HuffmanDecodingError):
        return None


def _bits(value: int, width: int) -> bytes:
    """``width`` bits (a multiple of 8) of ``value`` as bytes."""
    return value.to_bytes(width // 8, "big")


def test_the_code_table_derived_from_code_lengths_is_rfc7541_appendix_b_as_hpack_has_it():
    assert HUFFMAN_LENGTHS == tuple(REQUEST_CODES_LENGTH) and HUFFMAN_CODES == tuple(REQUEST_CODES)


def test_huffman_encoding_is_byte_for_byte_hpacks():
    rng = random.Random(9113)
    samples = [bytes([b]) for b in range(256)] + [b"", b"/api/v1/namespaces/default", b"\xff" * 300]
    samples += [bytes(rng.randrange(256) for _ in range(rng.randrange(600))) for _ in range(300)]
    for raw in samples:
        assert huffman_encode(raw) == encode(raw), raw
    for coded, text in APPENDIX_C:
        assert huffman_encode(text) == bytes.fromhex(coded)


@pytest.mark.parametrize(("coded", "text"), APPENDIX_C)
def test_rfc7541_appendix_c_strings_decode_to_the_rfc_text(coded, text):
    data = bytes.fromhex(coded)
    assert decode(data) == text == reference(data)
    assert decode(memoryview(data)) == decode(bytearray(data)) == text


def test_every_octet_alone_and_random_strings_of_every_octet_decode_as_hpack_does():
    rng = random.Random(7541)
    samples = [bytes([b]) for b in range(256)] + [b""]
    samples += [bytes(rng.randrange(256) for _ in range(rng.randrange(2001))) for _ in range(300)]
    samples += [rng.choice([b"/api/v1/", b"a", b"0", b"~", b"\x00", b"\xff"]) * rng.randrange(1, 200)
                for _ in range(200)]
    for raw in samples:
        coded = encode(raw)
        assert decode(coded) == raw == reference(coded)


def test_code_followed_by_padding_is_valid_only_for_at_most_7_one_bits():
    # Each symbol's code, then enough trailing bits to fill whole octets (up to 15): all ones (a
    # prefix of EOS, which completes no symbol), or, under 5 bits (the shortest code), not all ones.
    checked = 0
    for symbol in range(256):
        code, length = REQUEST_CODES[symbol], REQUEST_CODES_LENGTH[symbol]
        for pad in range(16):
            if (length + pad) % 8:
                continue
            for bits in [(1 << pad) - 1] + ([0, (1 << pad) - 2] if 0 < pad < 5 else []):
                data = _bits((code << pad) | bits, length + pad)
                valid = pad <= 7 and bits == (1 << pad) - 1
                assert _outcome(decode, data) == (bytes([symbol]) if valid else None), (symbol, pad, bits)
                assert _outcome(reference, data) == _outcome(decode, data)
                checked += 1
    assert checked > 256


@pytest.mark.parametrize("data", [
    b"\xff\xff\xff\xfc",  # EOS (30 one bits) then 2 zero bits
    b"\xff\xff\xff\xff",  # EOS then 2 one bits: still EOS inside the string
    encode(b"ab") + b"\xff\xff\xff\xfc",  # symbols, then EOS
    _bits(((1 << 30) - 1) << 10 | 0b00000_11111, 40),  # EOS, then '0' and valid padding
    encode(b"a")[:1] + b"\xff",  # 'a' (5 bits), then 11 one bits of padding
    encode(b"/api") + b"\xff",  # a whole octet of one bits more than the padding
    b"\x18",  # 'a' then padding 000: not the most significant bits of EOS
    b"\x1e",  # 'a' then padding 110
    b"\xfe",  # an unfinished code ('!' is 11111110 00): 8 bits left over, and not EOS's prefix
])
def test_eos_inside_or_bad_padding_is_rejected_like_hpack(data):
    with pytest.raises(HuffmanDecodingError):
        decode(data)
    with pytest.raises(HPACKDecodingError):
        reference(data)


def test_random_garbage_is_rejected_or_decoded_exactly_as_hpack_does():
    rng = random.Random(5)
    valid = invalid = 0
    for n in range(6000):
        kind = n % 3
        if kind == 0:  # plain random octets
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(12)))
        elif kind == 1:  # one-heavy octets: EOS prefixes, long codes, padding cases
            data = bytes(rng.choice((0xFF, 0xFF, 0xFE, 0x7F, 0xFC, rng.randrange(256)))
                         for _ in range(rng.randrange(1, 9)))
        else:  # a valid string, then one octet changed, dropped or appended
            data = bytearray(encode(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 20)))))
            i = rng.randrange(len(data))
            action = rng.randrange(3)
            if action == 0:
                data[i] ^= 1 << rng.randrange(8)
            elif action == 1:
                del data[-1]
            else:
                data.append(rng.randrange(256))
            data = bytes(data)
        ours, theirs = _outcome(decode, data), _outcome(reference, data)
        assert ours == theirs, data.hex()
        valid += ours is not None
        invalid += ours is None
    assert valid > 500 and invalid > 500  # both sides of the rule were exercised


def test_a_bad_huffman_string_fails_the_connection_as_hpack_refuses_it():
    for value in (b"\xff\xff\xff\xff", encode(b"x-token") + b"\xff", b"\x18"):
        with pytest.raises(HPACKDecodingError):
            reference(value)
        block = _huffman_literal(b"x-h", value)
        with pytest.raises(HeaderBlockError, match="Huffman"):
            BlockDecoder(1 << 20).decode(block)
        c = Client()
        c.open()
        assert c.connection_error(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, 1, block)) == \
            ErrorCodes.COMPRESSION_ERROR
        # The same string, valid, in a long value (the memoized range): still refused every time.
        long_block = _huffman_literal(b"x-h", encode(b"v" * 100) + value)
        for _ in range(2):
            with pytest.raises(HeaderBlockError, match="Huffman"):
                BlockDecoder(1 << 20).decode(long_block)


def _literal_without_indexing(name_index: int, coded_value: bytes) -> bytes:
    """A literal without indexing (0000), static name ``name_index`` (< 15), Huffman value (< 127 bytes)."""
    assert name_index < 15 and len(coded_value) < 127
    return bytes([name_index, 0x80 | len(coded_value)]) + coded_value


def test_short_paths_hit_the_short_memo_but_short_secrets_never_enter_it():
    huffman._short_memo.cache_clear()
    path = encode(b"/api/v1/namespaces/default")
    secret = b"Bearer short"  # under MEMO_MIN_BYTES coded: memoized nowhere, as before
    assert huffman.SHORT_MEMO_MIN_BYTES <= len(path) < huffman.MEMO_MIN_BYTES
    assert huffman.SHORT_MEMO_MIN_BYTES <= len(encode(secret)) < huffman.MEMO_MIN_BYTES
    encoder = hpack.Encoder()
    blocks = [
        _literal_without_indexing(4, path),  # :path, static index 4, as nghttp2 sends it
        encoder.encode([(b"authorization", secret)], huffman=True),  # with indexing, by name
        encoder.encode([NeverIndexedHeaderTuple(b"x-secret", secret)], huffman=True),  # marked sensitive
        encoder.encode([(b"proxy-authorization", secret + b"2"), (b"cookie", b"session=abc")], huffman=True),
        _huffman_literal(b"Authorization", encode(secret + b"3")),  # malformed name, refused later: still a secret
    ]
    decoder = BlockDecoder(1 << 20)
    for _ in range(3):
        fields = [field for block in blocks for field in decoder.decode(block)]
    assert (b":path", b"/api/v1/namespaces/default") in fields
    assert (b"x-secret", secret) in fields and (b"cookie", b"session=abc") in fields
    info = huffman._short_memo.cache_info()
    assert info.hits >= 2  # the path: decoded once, then from the memo
    # Probe the memo's keys through its statistics: a secret lookup would be a hit if it were kept.
    for value in (secret, secret + b"2", secret + b"3", b"session=abc"):
        before = huffman._short_memo.cache_info()
        huffman._short_memo(encode(value))
        after = huffman._short_memo.cache_info()
        assert (after.hits, after.misses) == (before.hits, before.misses + 1), value
    before = huffman._short_memo.cache_info()
    huffman._short_memo(path)
    assert huffman._short_memo.cache_info().hits == before.hits + 1


def test_short_memo_is_bounded_and_keeps_only_its_size_range():
    huffman._short_memo.cache_clear()
    for i in range(huffman.SHORT_MEMO_ENTRIES + 50):
        assert huffman.decode_memo_short(encode(b"/p/%06d" % i)) == b"/p/%06d" % i
    info = huffman._short_memo.cache_info()
    assert info.currsize == huffman.SHORT_MEMO_ENTRIES
    huffman.decode_memo_short(encode(b"ab"))  # under SHORT_MEMO_MIN_BYTES coded
    huffman.decode_memo_short(encode(b"t" * 200))  # long: the long memo's business
    assert huffman._short_memo.cache_info()[:2] == info[:2]
    with pytest.raises(HuffmanDecodingError):
        huffman.decode_memo_short(b"\xff\xff\xff\xff\x00")
    with pytest.raises(HuffmanDecodingError):  # raised again: errors are never cached
        huffman.decode_memo_short(b"\xff\xff\xff\xff\x00")
