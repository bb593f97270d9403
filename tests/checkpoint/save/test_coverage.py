"""Which surviving local-tier copies rebuild a step for a new world (checkpoint/save/coverage.py):
the plan every rank computes from the gathered holdings."""

from harness.checkpoint.save.coverage import Copy, Coverage, plan

DDP = Coverage(global_data=True)


def copies(step, owners, world, *, exact=True, timeline="t", sharded=False):
    return [Copy(step, owner, world, timeline, exact=exact, sharded=sharded) for owner in owners]


def test_a_survivor_of_two_resumes_alone_from_its_own_copy_at_the_newest_step():
    """World 2 -> 1, node 1 gone with its disk: rank 0's own copies of 6 and 2 (and its peer copy
    of rank 1's 6) are left; step 6 from its own folder, nothing moved."""
    chosen = plan([copies(6, [0, 1], 2) + copies(2, [0], 2)], DDP)
    assert chosen.step == 6 and chosen.moves == [] and not chosen.from_peer
    assert chosen.sources[0].copy.owner == 0 and chosen.saved_world == 2


def test_a_regrown_rank_receives_a_copy_of_the_replicated_state():
    """World 1 -> 2 with a fresh node: rank 1 holds nothing and gets rank 0's copy."""
    chosen = plan([copies(10, [0], 1), []], DDP)
    assert chosen.step == 10
    ((rank, source),) = chosen.moves
    assert (rank, source.holder, source.copy.owner) == (1, 0, 0) and chosen.from_peer


def test_four_to_two_prefers_the_ranks_own_copies_then_those_held_here():
    held = [copies(8, [0], 4) + copies(8, [3], 4), copies(8, [1], 4) + copies(8, [0], 4)]
    chosen = plan(held, DDP)
    assert [(s.holder, s.copy.owner) for s in chosen.sources] == [(0, 0), (1, 1)]
    assert chosen.moves == []


def test_the_same_world_takes_each_ranks_own_copy_from_its_peer():
    """A replacement node (2 -> 2): rank 1's own copy of 12 comes from rank 0's peer folder."""
    chosen = plan([copies(12, [0, 1], 2), []], DDP)
    assert [(s.holder, s.copy.owner) for s in chosen.sources] == [(0, 0), (0, 1)]


def test_outside_exact_mode_a_rank_at_the_same_world_needs_its_own_streams():
    """Non-exact, 2 -> 2, rank 1's copy of 12 still on its way: 12 cannot serve rank 1 (its
    dropout streams are its own), 10 can; in exact mode 12 serves both ranks."""
    held = [copies(12, [0], 2, exact=False) + copies(10, [0, 1], 2, exact=False), []]
    chosen = plan(held, DDP)
    assert chosen.step == 10
    ((step, why),) = chosen.passed
    assert step == 12 and "random streams are its own" in why and "rank 1 of 2" in why
    exact = plan([copies(12, [0], 2) + copies(10, [0, 1], 2), []], DDP)
    assert exact.step == 12 and [(s.holder, s.copy.owner) for s in exact.sources] == [(0, 0), (0, 0)]


def test_outside_exact_mode_another_world_size_is_served_by_any_copy():
    """The streams are restarted at another world size outside exact mode (run/elastic.py)."""
    chosen = plan([copies(6, [0], 2, exact=False)], DDP)
    assert chosen.step == 6


def test_fsdp_at_another_world_size_reads_the_union_of_one_copy_per_rank_that_wrote_the_shards():
    """World 2 -> 1: the survivor holds its own copy and its peer copy of rank 1's: it reads its
    state from its own and its (whole) share of the shards from both; with the peer copy gone the
    step is not covered, and the reason names the lost shards."""
    both = plan([copies(6, [0, 1], 2, sharded=True)], DDP)
    assert both.step == 6 and both.moves == [] and both.from_peer
    assert [(s.holder, s.copy.owner) for s in both.shards[0]] == [(0, 0), (0, 1)]
    alone = plan([copies(6, [0], 2, sharded=True)], DDP)
    assert alone.step is None and "FSDP shards of rank(s) 1 of 2 survive in no copy" in alone.passed[0][1]


def test_fsdp_regrown_and_halved_worlds_receive_every_shard_copy_they_lack_once():
    """1 -> 2: rank 1 receives rank 0's world-1 copy once (its source and its shards). 4 -> 2 with
    peer copies on the other node: each rank holds two of the four and receives the other two."""
    regrow = plan([copies(10, [0], 1, sharded=True), []], DDP)
    assert regrow.step == 10 and [(r, s.holder, s.copy.owner) for r, s in regrow.moves] == [(1, 0, 0)]
    # at world 2 rank 0 reads its half of the world-1 shards: the union is its own copy alone
    assert [(s.holder, s.copy.owner) for s in regrow.shards[0]] == [(0, 0)]
    halved = plan([copies(8, [0, 2], 4, sharded=True), copies(8, [1, 3], 4, sharded=True)], DDP)
    assert halved.step == 8
    assert [(r, s.holder, s.copy.owner) for r, s in halved.moves] == [(0, 1, 1), (0, 1, 3), (1, 0, 0), (1, 0, 2)]


def test_fsdp_at_the_same_world_reads_its_own_shards_and_an_iterator_serves_its_owner_only():
    same = plan([copies(6, [0], 2, sharded=True), copies(6, [1], 2, sharded=True)], DDP)
    assert same.step == 6 and same.moves == [] and same.shards == ((), ()) and not same.from_peer
    iterator = plan([copies(6, [0, 1], 2)], Coverage(global_data=False))
    assert iterator.step is None and "iterator" in iterator.passed[0][1]


def test_copies_of_one_step_from_two_histories_are_never_combined():
    """A node that missed a resume kept its abandoned future: its step 10 differs from the one
    the others trained again, so 10 is passed over for the older step they agree on."""
    held = [copies(10, [0], 1, timeline="new") + copies(6, [0], 2), copies(10, [1], 2, timeline="old")]
    chosen = plan(held, DDP)
    assert chosen.step == 6 and "abandoned history" in chosen.passed[0][1]


def test_nothing_held_is_no_plan():
    assert plan([[], []], DDP).step is None
