from kvturn.wire import DIGEST_CHUNK_TOKENS, common_prefix_tokens, prefix_digests


def test_digests_cover_only_full_chunks() -> None:
    assert prefix_digests(list(range(15))) == []
    assert len(prefix_digests(list(range(16)))) == 1
    assert len(prefix_digests(list(range(47)))) == 2


def test_digests_are_chained() -> None:
    a = prefix_digests(list(range(64)))
    b = prefix_digests([999, *range(1, 64)])
    # A change in the first chunk changes every later digest, not just the first.
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_common_prefix_stops_at_the_first_differing_chunk() -> None:
    held = list(range(100))
    digests = prefix_digests(held)
    assert common_prefix_tokens(digests, held) == 96
    assert common_prefix_tokens(digests, [*held, 1, 2, 3]) == 96
    edited = [*held[:40], 7, *held[41:]]
    assert common_prefix_tokens(digests, edited) == 32
    assert common_prefix_tokens(digests, held[:20]) == DIGEST_CHUNK_TOKENS
    assert common_prefix_tokens(digests, [5, *held[1:]]) == 0
    assert common_prefix_tokens([], held) == 0
