"""The HPACK decoder (``h2wire.hpack_decode.BlockDecoder``) against ``hpack``'s, and its limits."""

from __future__ import annotations

import random

import pytest
from hpack import Decoder, Encoder, NeverIndexedHeaderTuple
from hpack.exceptions import HPACKError

from gatekeeper.proxy.h2wire.hpack_decode import BlockDecoder, HeaderBlockError, HeaderListTooLarge

NAMES = [b":method", b":path", b"accept", b"authorization", b"user-agent", b"x-a", b"x-b", b"content-type",
         b"cookie", b"x-long-name-" + b"n" * 40]


def _random_block(rng: random.Random) -> list[tuple[bytes, bytes]]:
    fields = []
    for _ in range(rng.randint(0, 12)):
        name = rng.choice(NAMES)
        value = rng.choice([b"", b"GET", b"/api/v1/pods", bytes(rng.randrange(256) for _ in range(rng.randint(0, 300))),
                            b"v" * rng.randint(0, 2000)])
        fields.append(NeverIndexedHeaderTuple(name, value) if rng.random() < 0.2 else (name, value))
    return fields


def test_decodes_what_hpack_encodes_exactly_as_hpack_decodes_it():
    rng = random.Random(7)
    encoder, theirs, ours = Encoder(), Decoder(), BlockDecoder(1 << 20)
    theirs.max_header_list_size = 1 << 20
    for i in range(400):
        if i % 50 == 25:
            encoder.header_table_size = rng.choice([0, 256, 1024, 4096])  # size update at the next block
        block = encoder.encode(_random_block(rng), huffman=rng.random() < 0.5)
        expected = [(bytes(n), bytes(v)) for n, v in theirs.decode(block, raw=True)]
        assert ours.decode(block) == expected
        assert list(ours._table) == [(bytes(n), bytes(v)) for n, v in theirs.header_table.dynamic_entries]


def test_rejects_every_corrupted_block_hpack_rejects():
    rng = random.Random(11)
    rejected = 0
    for _ in range(600):
        encoder, theirs, ours = Encoder(), Decoder(), BlockDecoder(1 << 20)
        block = bytearray(encoder.encode(_random_block(rng), huffman=rng.random() < 0.5))
        for _ in range(rng.randint(1, 3)):
            if block:
                block[rng.randrange(len(block))] = rng.randrange(256)
        if rng.random() < 0.3:
            block = block[: rng.randrange(len(block) + 1)]
        try:
            expected = [(bytes(n), bytes(v)) for n, v in theirs.decode(bytes(block), raw=True)]
        except (HPACKError, IndexError, TypeError, ValueError):
            rejected += 1
            with pytest.raises(HeaderBlockError):
                ours.decode(bytes(block))
        else:
            assert ours.decode(bytes(block)) == expected
    assert rejected > 100  # the corruption did produce invalid blocks


@pytest.mark.parametrize("block", [
    b"\x80",  # index 0
    b"\xbf\x01",  # index 62 with an empty dynamic table
    b"\x82\x3f\xe1\x1f",  # size update after a field
    b"\x3f\xe2\x1f",  # size update to 4097, above our SETTINGS_HEADER_TABLE_SIZE
    b"\x40\x85\xff\xff\xff\xff\xff\x00",  # Huffman string with EOS
    b"\x00\x05ab",  # string past the end of the block
    b"\xff\xff\xff\xff\xff\xff\x7f",  # integer without an end
])
def test_malformed_blocks_are_errors(block):
    with pytest.raises(HeaderBlockError):
        BlockDecoder(1 << 20).decode(block)


def test_header_list_over_the_limit_is_its_own_error():
    block = Encoder().encode([(b"x-big", b"b" * 100)])
    assert BlockDecoder(100 + 5 + 32).decode(block) == [(b"x-big", b"b" * 100)]
    with pytest.raises(HeaderListTooLarge):
        BlockDecoder(100 + 5 + 31).decode(block)


def test_an_entry_larger_than_the_table_empties_it():
    encoder, ours = Encoder(), BlockDecoder(1 << 20)
    ours.decode(encoder.encode([(b"x-a", b"1")]))
    assert len(ours._table) == 1
    ours.decode(encoder.encode([(b"x-huge", b"h" * 5000)]))
    assert len(ours._table) == 0 and ours._used == 0
