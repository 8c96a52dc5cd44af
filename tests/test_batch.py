"""Several requests in one forward (`mcsd.forward.slots`, `mcsd.decoding.batch`): each answer is the one
the request gets decoded alone, whatever else is in the batch and whenever it arrived."""

import contextlib

import pytest
import torch
from conftest import exact_two_token_probs, pooled_chi_square_p, tiny_llama

from mcsd.config import ConfigError, SamplingConfig
from mcsd.core.output import GenerationStats
from mcsd.decoding.batch import BatchDecoder
from mcsd.decoding.decoder import TreeDecoder
from mcsd.drafting.context import ContextDrafter
from mcsd.forward import native, quant
from mcsd.forward.attention import causal_allowed
from mcsd.forward.lm import CachedLM
from mcsd.forward.slots import Block, SlotBlocks, SlotCache, SlotForward

EOS = 5
PROMPTS = [[3, 4, 5, 6, 7, 3, 4, 5], [9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 20, 21, 22],
           [40], [7, 8, 7, 8, 7, 8, 7], [12, 13, 14, 15, 16]]
LENGTHS = [17, 9, 30, 4, 25, 12]


@pytest.fixture(scope="module")
def eos_target():
    return tiny_llama(3, eos=EOS, sharpness=3.0)


def _decoder(target, context=True):
    """Context drafting (each slot grafts its own trees), or a model drafter (which does not draft in a
    batch: its slots decode plainly there, and alone with its trees)."""
    if context:
        return TreeDecoder(target, ContextDrafter(), attention="sdpa", calibrate=False)
    return TreeDecoder(target, tiny_llama(1, layers=1), tree="2,2,1", policy="static", attention="sdpa",
                       calibrate=False)


def _lone_outputs(model, prompt, steps):
    """Logits of a prompt and then of its steps (each a token, or a list of tokens read as one causal
    block), one sequence on its own."""
    lm = CachedLM(model, lean=True)
    lm.reset()
    outs = [lm.extend(prompt)]
    for t in steps:
        outs.append(lm.extend(torch.tensor(t).reshape(-1)))
    return outs


def _batched_outputs(model, prompts, steps, fixed=False):
    lm = CachedLM(model, lean=True)
    forward = (SlotBlocks(lm.lean_forward(), model, capture=False) if fixed else
               SlotForward(lm.lean_forward(), model))
    cache = SlotCache.for_model(forward.lean, len(prompts) + 1)
    got = [[] for _ in prompts]
    with torch.inference_mode():
        blocks = [Block(i + 1, p, torch.arange(p.numel()), causal_allowed(p.numel())) for i, p in enumerate(prompts)]
        for i, out in enumerate(forward(cache, blocks)):
            got[i].append(out)
        for k in range(len(steps[0])):
            rows = [torch.tensor(s[k]).reshape(-1) for s in steps]
            blocks = [Block(i + 1, r, torch.arange(cache.lengths[i + 1], cache.lengths[i + 1] + r.numel()),
                            causal_allowed(r.numel())) for i, r in enumerate(rows)]
            for i, out in enumerate(forward(cache, blocks)):
                got[i].append(out)
    return got


FORWARD_PROMPTS = [torch.tensor([3, 4, 5, 6, 7]), torch.tensor([9, 10, 11]), torch.tensor(list(range(20, 28)))]
FORWARD_STEPS = [[8, 9, 10], [12, 13, 14], [30, 31, 32]]
FORWARD_BLOCKS = [[[8, 9], [10], [11, 12, 13]], [[14, 15, 16], [17, 18], [19]], [[30], [31, 32, 33], [34, 35]]]


@pytest.mark.parametrize("fixed", [False, True])
def test_a_slots_rows_in_a_batched_forward_are_its_lone_rows(target, fixed):
    """Flat (the blocks' own rows) and in fixed shapes (every slot, padded: slot 0 runs padding alone)."""
    want = [_lone_outputs(target, p, s) for p, s in zip(FORWARD_PROMPTS, FORWARD_STEPS)]
    got = _batched_outputs(target, FORWARD_PROMPTS, FORWARD_STEPS, fixed)
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            assert a.shape == b.shape
            # torch's dense products over more rows may round the last bits differently
            assert torch.allclose(a, b, atol=1e-6, rtol=0)
            assert torch.equal(a.argmax(-1), b.argmax(-1))


@contextlib.contextmanager
def _on_native_q4(tmp_path, monkeypatch, act8: bool):
    """A tiny model on the native kernel's Q4_1 codes (8-bit activations with `act8`); skips where that
    kernel does not run."""
    from test_native_layer import _on_q4_codes
    monkeypatch.setenv("MCSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MCSD_NATIVE", "1")
    native.reset()
    try:
        if quant.kernel_name() != "native":
            pytest.skip(f"the native q4 kernel does not run here ({native.reason()})")
        yield _on_q4_codes(tiny_llama(0), tmp_path / "q4.gguf", act8=act8)
    finally:
        native.reset()


@pytest.mark.parametrize("act8, native_head, steps", [(False, False, FORWARD_STEPS), (False, True, FORWARD_STEPS),
                                                     (True, True, FORWARD_STEPS), (True, True, FORWARD_BLOCKS)])
def test_on_the_native_layers_a_slots_logits_are_its_lone_logits_bit_for_bit(tmp_path, monkeypatch, act8,
                                                                              native_head, steps):
    """With a native LM head too, whose one call then covers every block's rows; steps of a row a slot,
    and blocks of one to three rows a slot (a batch's trees: the slots' attention in one parallel region)."""
    with _on_native_q4(tmp_path, monkeypatch, act8) as model:
        if native_head:
            assert quant.attach_q8(model.lm_head) == 1
        lm = CachedLM(model, lean=True)
        assert lm.lean_forward().native_layers() is not None
        assert quant.row_invariant(model.lm_head, torch.float32) == native_head
        calls = []
        monkeypatch.setattr(quant.Q8Linear, "__call__",
                            lambda self, x, call=quant.Q8Linear.__call__: calls.append(x.shape) or call(self, x))
        want = [_lone_outputs(model, p, s) for p, s in zip(FORWARD_PROMPTS, steps)]
        got = _batched_outputs(model, FORWARD_PROMPTS, steps)
        for w, g in zip(want, got):
            for a, b in zip(w, g):
                assert torch.equal(a, b)
        if native_head:          # the last round: the three slots' rows in one call of the head
            assert calls[-1][-2] == sum(torch.tensor(s[-1]).numel() for s in steps)


def test_a_slot_commits_its_own_path_and_leaves_the_others(target):
    lm = CachedLM(target, lean=True)
    cache = SlotCache.for_model(lm.lean_forward(), 2)
    cache.reserve(8)
    before = cache.keys.clone()
    cache.lengths = [3, 6]
    cache.commit(1, 2, torch.tensor([0, 2, 3]))
    assert cache.lengths == [3, 5]
    assert torch.equal(cache.keys[:, 1, :, 2:5], before[:, 1, :, [2, 4, 5]])
    assert torch.equal(cache.keys[:, 0], before[:, 0])


def _lone(decoder, prompt, n, **options):
    return decoder.generate(prompt, max_new_tokens=n, **options)


@pytest.mark.parametrize("context, fixed", [(True, False), (False, False), (True, True)])
def test_greedy_batched_answers_equal_lone_answers_with_mixed_lengths_arrivals_and_finishes(eos_target, context,
                                                                                             fixed):
    dec = _decoder(eos_target, context)
    want = [_lone(dec, p, n) for p, n in zip(PROMPTS, LENGTHS)]
    assert len({len(w.tokens) for w in want}) > 2 and any(w.finish_reason == "eos" for w in want)
    assert dec.generate_baseline(PROMPTS[2], max_new_tokens=LENGTHS[2]).tokens == want[2].tokens
    batch = BatchDecoder(dec, max_batch=3, prefill_tokens=6, fixed_shapes=fixed)   # the 14-token prompt: 3 rounds
    assert isinstance(batch.forward, SlotBlocks if fixed else SlotForward)
    first = [batch.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS[:4], LENGTHS[:4])]
    for _ in range(3):
        batch.step()
    later = [batch.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS[4:], LENGTHS[4:])]   # arrive mid-way
    sizes = []
    while not batch.idle:
        batch.step()
        sizes.append(batch.last_batch)
    assert max(sizes) == 3 and min(sizes) < 3
    for request, w in zip(first + later, want):
        assert request.output.tokens == w.tokens
        assert request.output.finish_reason == w.finish_reason
    if context:
        assert sum(r.output.stats.context_nodes for r in first + later) > 0


def test_greedy_answers_do_not_depend_on_the_batch_size(eos_target):
    dec = _decoder(eos_target)
    alone = [BatchDecoder(dec, max_batch=1).generate([p], max_new_tokens=n)[0].tokens
             for p, n in zip(PROMPTS, LENGTHS)]
    for size in (2, 6):
        batch = BatchDecoder(dec, max_batch=size)
        got = [batch.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS, LENGTHS)]
        while not batch.idle:
            batch.step()
        assert [r.output.tokens for r in got] == alone


@pytest.mark.parametrize("fixed", [False, True])
def test_seeded_sampling_in_a_batch_is_the_lone_runs_text(eos_target, fixed):
    dec = _decoder(eos_target)
    options = dict(temperature=0.9, top_k=20)
    want = [_lone(dec, p, n, seed=100 + i, **options).tokens for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))]
    batch = BatchDecoder(dec, max_batch=4, prefill_tokens=5, fixed_shapes=fixed)
    order = list(range(len(PROMPTS)))[::-1]                                          # another order
    got = {i: batch.submit(PROMPTS[i], max_new_tokens=LENGTHS[i], seed=100 + i, **options) for i in order}
    while not batch.idle:
        batch.step()
    assert [got[i].output.tokens for i in range(len(PROMPTS))] == want


@pytest.mark.parametrize("method", ["gumbel", "rejection"])
def test_batched_sampling_follows_the_target(target, method):
    """The seeded Gumbel draw and multi-candidate rejection sampling, each through `BatchDecoder`."""
    sampling = SamplingConfig(temperature=1.0, top_k=8, top_p=1.0)     # 64 cells of (first, second)
    prompt = torch.tensor([1, 2, 3])
    vocab = target.config.vocab_size
    exact = exact_two_token_probs(target, prompt, sampling, vocab).flatten()
    batch = BatchDecoder(_decoder(target), max_batch=8)
    n = 1200
    # beside every request, others with other prompts, so that each round's forward mixes them
    requests = []
    for seed in range(n):
        requests.append(batch.submit(prompt, max_new_tokens=2, temperature=1.0, top_k=8, seed=seed,
                                     sampling_method=method))
        if seed % 4 == 0:
            batch.submit([7, 8, 9, 10, 11][: 1 + seed % 5], max_new_tokens=3, temperature=1.0, seed=seed,
                         sampling_method=method)
    while not batch.idle:
        batch.step()
    counts = torch.zeros(vocab * vocab)
    for r in requests:
        counts[r.output.tokens[0] * vocab + r.output.tokens[1]] += 1
    assert counts[exact == 0].sum() == 0                      # tokens outside the top-k never appear
    p = pooled_chi_square_p(counts, exact, n)
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_a_cancelled_request_frees_its_slot_at_once_and_the_others_go_on(eos_target):
    dec = _decoder(eos_target)
    want = [_lone(dec, p, n).tokens for p, n in zip(PROMPTS[:3], LENGTHS[:3])]
    batch = BatchDecoder(dec, max_batch=2)
    a = batch.submit(PROMPTS[0], max_new_tokens=LENGTHS[0])
    b = batch.submit([30, 31, 32], max_new_tokens=40, ignore_eos=True)
    c = batch.submit(PROMPTS[1], max_new_tokens=LENGTHS[1])
    batch.step()
    batch.step()
    assert c.slot is None and b.slot is not None
    batch.cancel(b)
    assert b.slot is None and b.output is None
    batch.step()
    assert c.rows                                  # took the freed slot at the next round
    d = batch.submit(PROMPTS[2], max_new_tokens=LENGTHS[2])
    while not batch.idle:
        batch.step()
    assert [a.output.tokens, c.output.tokens, d.output.tokens] == want


def test_what_a_batch_cannot_do_is_one_clear_error(target):
    dec = _decoder(target)
    with pytest.raises(ConfigError, match="max_batch"):
        BatchDecoder(dec, max_batch=0)
    with pytest.raises(ConfigError, match="prefill_tokens"):
        BatchDecoder(dec, prefill_tokens=0)
    with pytest.raises(ConfigError, match="lossy_target_roots"):
        BatchDecoder(TreeDecoder(target, tiny_llama(1, layers=1), tree="2,1", policy="static", calibrate=False,
                                 lossy_target_roots=2))
    with pytest.raises(ConfigError, match="temperature"):
        BatchDecoder(dec).submit([1, 2], temperature=-1)
    eager = TreeDecoder(tiny_llama(0), ContextDrafter(), attention="eager", calibrate=False)
    with pytest.raises(ConfigError, match="batched decoding needs a model the engine's own forward runs .*eager"):
        BatchDecoder(eager)


def test_a_slots_share_of_the_rows_is_the_lone_tree_alone_and_shrinks_toward_plain_rows_as_slots_join():
    from mcsd.costs.cost_model import Costs
    from mcsd.decoding.row_budget import MIN_ROWS, RowBudget
    budget = RowBudget(Costs.default(), 49)
    shares = [budget.per_slot(b) for b in range(1, 41)]
    assert shares[0] == 49
    assert all(a >= b for a, b in zip(shares, shares[1:]))            # never grows back as slots join
    assert shares[3] < shares[0] and shares[-1] == MIN_ROWS            # shrinks, never below a node
    # rows that cost nothing more (a forward far from bound by its products) are shared out whole
    free = RowBudget(Costs(verify={1: 1.0, 256: 1.0}, draft={1: 0.1}), 9)
    assert [free.per_slot(b) for b in (1, 4, 16)] == [9, 9, 9]
    even = RowBudget(None, 13)
    assert [even.per_slot(b) for b in (1, 2, 4, 100)] == [13, 6, 3, MIN_ROWS]


def test_trees_in_a_full_batch_keep_within_their_share_and_answers_stay_the_lone_ones(eos_target):
    from mcsd.costs.cost_model import Costs
    from mcsd.decoding.row_budget import RowBudget
    dec = TreeDecoder(eos_target, ContextDrafter(max_nodes=8), attention="sdpa", calibrate=False)
    prompts = [[7, 8, 7, 8, 7, 8, 7, 8] * 2, [3, 4, 5] * 4, PROMPTS[0], PROMPTS[4], [9, 9, 9, 9], [30, 31] * 5]
    want = [_lone(dec, p, 20, ignore_eos=True).tokens for p in prompts]
    batch = BatchDecoder(dec, max_batch=6)
    batch.budget = RowBudget(Costs.default(), 9)
    assert batch.budget.per_slot(1) == 9 and batch.budget.per_slot(6) == 2
    got = [batch.submit(p, max_new_tokens=20, ignore_eos=True) for p in prompts]
    tree_rows = []                                                    # (a slot's tree rows, slots decoding)
    while not batch.idle:
        decoding = {r.id for r in batch.active if r.sequence is not None}
        for r in batch.step():
            if r.id in decoding:
                tree_rows.append((r.rows[-1], len(decoding)))
    assert [r.output.tokens for r in got] == want
    assert all(rows <= batch.budget.per_slot(n) for rows, n in tree_rows if n == 6)
    assert any(rows == 2 for rows, n in tree_rows)                    # grafting still runs at a full batch


def test_a_slot_cache_keeps_what_it_holds_when_it_grows():
    cache = SlotCache(3, layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    cache.reserve(5)
    cache.keys.normal_()
    cache.values.normal_()
    keys, values, capacity = cache.keys.clone(), cache.values.clone(), cache.capacity
    cache.reserve(capacity + 1)
    assert cache.capacity >= 2 * capacity
    assert torch.equal(cache.keys[..., :capacity, :], keys) and torch.equal(cache.values[..., :capacity, :], values)
    assert all(torch.equal(k, cache.keys[i]) for i, k in enumerate(cache.layer_keys))


def test_beside_other_slots_a_slot_grafts_only_the_nodes_that_pay_for_their_place_in_the_round():
    """Rows nearly free up to 4 and dear past them: alone, the repeated text's continuation is grafted;
    beside three other slots' rows the same nodes would each add more to the round than they return."""
    from mcsd.costs.cost_model import Costs
    from mcsd.decoding.propose import Proposer
    from mcsd.drafting.policies import make_policy
    costs = Costs(verify={1: 4.0, 4: 4.2, 5: 8.0, 32: 116.0}, draft={1: 0.1})
    sequence = torch.tensor([7, 8, 9, 10, 11] * 6 + [7])

    def proposal(beside):
        proposer = Proposer(make_policy("static", ""), None, ContextDrafter(max_nodes=8), 0, costs)
        proposer.reset()
        proposer.context.reset(sequence)
        return proposer.propose(sequence, 100, SamplingConfig(), None, beside=beside)

    alone, crowded, light = proposal(None), proposal((3, 3.0)), proposal((1, 1.0))
    assert alone.grown.tree.size > 2 and alone.expected > 1.5
    assert alone.grown.tree.tokens[1].item() == 8                     # the repeat's next token
    assert crowded.grown.tree.size == 1 and crowded.expected == 1.0
    assert 1 < light.grown.tree.size <= 3                             # beside one row: up to the 4th row
    assert light.expected == pytest.approx(1.0 + light.graft.gain) and light.graft.gain > 0


def test_max_batch_from_the_costs_is_the_most_rows_within_two_lone_steps():
    from mcsd.costs.cost_model import Costs
    from mcsd.decoding.row_budget import MAX_SLOTS, max_batch
    assert max_batch(Costs(verify={1: 4.0, 6: 8.0, 7: 8.5}, draft={1: 0.1}, source="measured"))[0] == 6
    assert max_batch(Costs(verify={1: 4.0, 2: 8.5}, draft={1: 0.1}, source="measured"))[0] == 1
    assert max_batch(Costs(verify={1: 1.0, 256: 1.0}, draft={1: 0.1}, source="measured"))[0] == MAX_SLOTS
    assert max_batch(Costs.default()) == (1, "no costs measured on this machine")
    assert max_batch(None)[0] == 1
    slots, why = max_batch(Costs(verify={1: 4.0, 6: 8.0, 7: 8.5}, draft={1: 0.1}, source="measured"))
    assert why == "a forward of 6 rows costs 8.0 ms, within 2x one row's 4.0 ms"


def test_a_server_left_to_choose_batches_by_the_costs_or_answers_one_at_a_time_and_says_why(target, caplog):
    from mcsd.costs.cost_model import Costs
    from mcsd.serve.batching import BatchEngine
    dec = TreeDecoder(target, ContextDrafter(), attention="sdpa", calibrate=False)

    def engine(costs, decoder=dec):
        decoder.context_costs = costs
        e = BatchEngine(lambda: decoder, None, 4)
        e.decoder = decoder
        return e, e._batch_decoder()

    e, batch = engine(Costs(verify={1: 4.0, 3: 7.9, 4: 9.0}, draft={1: 0.1}, source="measured"))
    assert isinstance(batch, BatchDecoder) and batch.max_batch == e.max_batch == 3
    with caplog.at_level("INFO", logger="mcsd.serve"):
        e, batch = engine(Costs(verify={1: 4.0, 2: 9.0}, draft={1: 0.1}, source="measured"))
    assert batch is None and e.max_batch == 1 and "--max-batch auto: 1 (a forward of 1 rows" in caplog.text
    eager = TreeDecoder(target, ContextDrafter(), attention="eager", calibrate=False)
    with caplog.at_level("INFO", logger="mcsd.serve"):
        e, batch = engine(Costs(verify={1: 1.0, 256: 1.0}, draft={1: 0.1}, source="measured"), eager)
    assert batch is None and e.max_batch == 1 and "one at a time (batched decoding needs" in caplog.text
    explicit = BatchEngine(lambda: eager, 4, 4)
    explicit.decoder = eager
    with pytest.raises(ConfigError, match="batched decoding needs"):
        explicit._batch_decoder()


def test_a_requests_stats_give_its_share_of_the_batched_forwards(eos_target):
    dec = _decoder(eos_target)
    batch = BatchDecoder(dec, max_batch=3)
    got = [batch.submit(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(PROMPTS[:3], (6, 10, 14))]
    rounds = []                                          # (rows of each request this round, all rows, slots)
    while not batch.idle:
        fed = {id(r): len(r.rows) for r in got}
        batch.step()
        rows = {id(r): r.rows[-1] for r in got if len(r.rows) > fed[id(r)]}
        rounds.append((rows, batch.last_rows, batch.last_batch))
    for r in got:
        mine = [(rows[id(r)], all_rows, slots) for rows, all_rows, slots in rounds if id(r) in rows]
        s = r.output.stats
        assert s.batch_rounds == len(mine) and s.batch_rows == sum(m[0] for m in mine) == sum(r.rows)
        assert s.batch_share == pytest.approx(sum(m[0] for m in mine) / sum(m[1] for m in mine))
        assert s.batch_size == pytest.approx(sum(m[2] for m in mine) / len(mine))
        assert 0 < s.batch_share < 1 and 1 <= s.batch_size <= 3
        assert r.output.stats.as_dict()["batch_share"] == s.batch_share
    last = got[-1].output.stats                          # alone at the end: a share of 1 in those rounds
    assert any(len(rows) == 1 and id(got[-1]) in rows for rows, _, _ in rounds)
    assert last.batch_size < 3
    assert GenerationStats().batch_share is None and GenerationStats().as_dict()["batch_size"] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_batched_round_replays_captured_graphs_and_answers_as_alone():
    """On CUDA a batch runs in fixed shapes as CUDA graphs: each bucket captured once (a second batch
    over the same buckets captures nothing), greedy float32 answers the lone ones."""
    target = tiny_llama(3, eos=EOS, sharpness=3.0).cuda()
    dec = _decoder(target)
    want = [_lone(dec, torch.tensor(p).cuda(), n).tokens for p, n in zip(PROMPTS, LENGTHS)]
    batch = BatchDecoder(dec, max_batch=4)
    assert isinstance(batch.forward, SlotBlocks) and batch.forward.capture
    prompts = [torch.tensor(p).cuda() for p in PROMPTS]
    first = batch.generate(prompts[:4], max_new_tokens=8)        # (a lone answer shorter than 8 ends sooner)
    assert [o.tokens[:len(w[:8])] for o, w in zip(first, want)] == [w[:8] for w in want[:4]]
    got = [o.tokens for o in batch.generate(prompts, max_new_tokens=max(LENGTHS))]
    assert batch.forward.captures > 0 and batch.forward.failure is None
    captured = batch.forward.captures
    assert [o.tokens for o in batch.generate(prompts, max_new_tokens=max(LENGTHS))] == got
    assert batch.forward.captures == captured
    assert [g[:n] for g, n in zip(got, LENGTHS)] == want


def test_a_batch_over_a_target_cast_since_refuses_a_request_and_queues_nothing():
    target = tiny_llama(3, eos=EOS, sharpness=3.0)
    batch = BatchDecoder(_decoder(target), max_batch=2)
    target.to(torch.bfloat16)
    with pytest.raises(ConfigError, match="build a new TreeDecoder for the cast pair"):
        batch.submit(PROMPTS[0], max_new_tokens=4)
    assert batch.idle and not batch.waiting


def test_a_fixed_shape_round_reads_nothing_on_the_host(target):
    """Filling a bucket and running it makes no host read (counted at the dispatcher, the CPU running
    the operators CUDA runs): on CUDA a round's one wait is the caller's read of its logits."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from host_reads import counting_host_reads, cuda_operators
    with cuda_operators():
        lm = CachedLM(target, lean=True)
        forward = SlotBlocks(lm.lean_forward(), target, capture=False)
        cache = SlotCache.for_model(forward.lean, 3)
        with torch.inference_mode():
            prompts = [Block(0, torch.tensor([3, 4, 5]), torch.arange(3), causal_allowed(3), last_only=True),
                       Block(2, torch.tensor([9, 10]), torch.arange(2), causal_allowed(2), last_only=True)]
            forward(cache, prompts)                                          # buffers made (capacity reserved)
            steps = [Block(0, torch.tensor([6, 7]), torch.tensor([3, 4]), causal_allowed(2)),
                     Block(2, torch.tensor([11]), torch.tensor([2]), causal_allowed(1))]
            with counting_host_reads() as reads:
                logits = forward(cache, steps)
    assert reads == [] and [x.shape[0] for x in logits] == [2, 1] and cache.lengths == [5, 0, 3]


# ---------------------------------------------------------------------------------------------- failures


class _FailsAt:
    """A logits processor that raises at its `after`-th call (a request's own part of a round)."""

    def __init__(self, after: int):
        self.calls, self.after = 0, after

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls >= self.after:
            raise RuntimeError("this request's processor broke")
        return scores


def test_a_failure_while_finishing_one_request_fails_that_request_alone(eos_target, monkeypatch):
    dec = _decoder(eos_target)
    want = [_lone(dec, p, n).tokens for p, n in zip(PROMPTS[:3], LENGTHS[:3])]
    batch = BatchDecoder(dec, max_batch=3)
    requests = [batch.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS[:3], LENGTHS[:3])]
    finish = BatchDecoder._finish

    def failing_finish(self, request):
        if request is requests[1]:
            raise RuntimeError("finishing this one broke")
        finish(self, request)

    monkeypatch.setattr(BatchDecoder, "_finish", failing_finish)
    while not batch.idle:
        batch.step()
    assert str(requests[1].error) == "finishing this one broke" and requests[1].output is None
    assert requests[1].slot is None and batch.idle
    assert [requests[0].output.tokens, requests[2].output.tokens] == [want[0], want[2]]


def test_generate_raises_the_failed_requests_own_error_and_keeps_the_others_answers(eos_target):
    from mcsd.decoding.batch import RequestFailed
    dec = _decoder(eos_target)
    batch = BatchDecoder(dec, max_batch=2)
    want = [_lone(dec, p, 6).tokens for p in PROMPTS[:3]]
    # one processor object for every prompt: it raises in whichever request calls it 8th
    with pytest.raises(RequestFailed, match=r"prompt \d failed: RuntimeError: this request's processor broke") as info:
        batch.generate(PROMPTS[:3], max_new_tokens=6, logits_processor=[_FailsAt(8)])
    failed = info.value
    assert isinstance(failed.__cause__, RuntimeError) and failed.error is failed.outputs[failed.index]
    assert batch.idle
    assert all(isinstance(o, Exception) or o.tokens == w for o, w in zip(failed.outputs, want))
    assert [o.tokens for o in batch.generate(PROMPTS[:3], max_new_tokens=6)] == want    # the batch serves on


# ---------------------------------------------------------------------------------------------- memory


def test_the_slot_cache_is_bounded_counts_its_memory_and_shrinks_when_a_long_sequence_leaves():
    from mcsd.forward.static_cache import HEADROOM
    cache = SlotCache(3, layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu", limit=2000)
    assert cache.position_bytes == 2 * 2 * 2 * 4 * 4 and cache.nbytes == 0
    assert cache.bound_bytes == 3 * 2000 * cache.position_bytes
    cache.reserve(10)
    cache.lengths = [10, 10, 0]
    small = cache.nbytes
    cache.reserve(1900)                                   # one long sequence: doubling stops at the limit
    cache.lengths[2] = 1900
    assert cache.capacity == 2000 and cache.nbytes == cache.bound_bytes
    with pytest.raises(ValueError, match="past the slot cache's limit of 2000"):
        cache.reserve(2001)
    cache.free(2)                                         # it leaves: the others' room comes back
    assert cache.capacity == 10 + HEADROOM and cache.nbytes == small


def test_one_long_request_grows_the_batchs_memory_no_further_than_its_bound_and_only_while_held():
    from mcsd.forward.static_cache import HEADROOM
    target = tiny_llama(3, eos=EOS, sharpness=3.0)
    target.config.max_position_embeddings = window = 2048
    dec = _decoder(target)
    batch = BatchDecoder(dec, max_batch=3)
    assert batch.cache.limit == window + 64
    assert batch.cache.bound_bytes == 3 * (window + 64) * batch.cache.position_bytes
    short = [batch.submit(p, max_new_tokens=60, ignore_eos=True) for p in PROMPTS[:2]]
    batch.step()
    before = batch.cache.nbytes
    long = batch.submit([(7 + i) % 60 + 2 for i in range(1200)], max_new_tokens=4, ignore_eos=True)
    peak = 0
    while not long.done:
        batch.step()
        peak = max(peak, batch.cache.nbytes)
    assert before < peak <= batch.cache.bound_bytes
    assert not any(r.done for r in short)                 # the long one left while the others decode:
    held = max(batch.cache.lengths)                       # their room is what they need again
    assert batch.cache.capacity <= held + HEADROOM + 64 and batch.cache.nbytes < peak / 2
    while not batch.idle:
        batch.step()
    assert [len(r.output.tokens) for r in short + [long]] == [60, 60, 4]


# ---------------------------------------------------------------------------------------------- admission


def test_a_burst_joins_in_one_round_and_its_prompts_prefill_together(eos_target):
    dec = _decoder(eos_target)
    batch = BatchDecoder(dec, max_batch=4)
    burst = [batch.submit(p, max_new_tokens=4, ignore_eos=True) for p in PROMPTS[:3]]
    advanced = batch.step()
    assert all(r.slot is not None for r in burst) and not batch.waiting
    assert batch.last_batch == 3 and batch.last_rows == sum(len(p) for p in PROMPTS[:3])   # one forward
    assert set(advanced) == set(burst) and all(len(r.new) == 1 for r in burst)


def test_a_group_holding_every_slot_gives_the_next_free_one_to_a_newcomer(eos_target):
    dec = _decoder(eos_target)
    batch = BatchDecoder(dec, max_batch=3)
    big = "job with 12 runs"
    runs = [batch.submit([3 + i, 4, 5], max_new_tokens=4 + i, ignore_eos=True, group=big) for i in range(12)]
    batch.step()
    assert [r.group for r in batch.active] == [big] * 3
    newcomer = batch.submit(PROMPTS[1], max_new_tokens=4, ignore_eos=True, group="another job")
    while not any(r.done for r in runs):
        batch.step()
        assert newcomer.slot is None
    batch.step()                                          # the first slot that frees is the newcomer's
    assert newcomer.slot is not None and newcomer.rows
    while not batch.idle:
        batch.step()
        assert len(batch.active) <= 3
    assert all(r.output is not None for r in runs + [newcomer])


# ---------------------------------------------------------------------------------------------- alone


def _head_decoder(target, context=True):
    from test_feature_draft import random_head

    from mcsd.drafting.feature_draft import FeatureDrafter
    head = FeatureDrafter(random_head(target), target)
    return TreeDecoder(target, [head, ContextDrafter()] if context else head, tree="3,2,1", policy="static",
                       attention="sdpa", calibrate=False)


@pytest.mark.parametrize("context", [True, False])
def test_a_request_alone_in_the_batch_drafts_with_the_feature_head_as_the_lone_round_does(eos_target, context):
    dec = _head_decoder(eos_target, context)
    prompt = PROMPTS[0] * 3
    plain = dec.generate_baseline(prompt, max_new_tokens=40, ignore_eos=True)
    lone = dec.generate(prompt, max_new_tokens=40, ignore_eos=True)
    batch = BatchDecoder(dec, max_batch=4)
    out = batch.generate([prompt], max_new_tokens=40, ignore_eos=True)[0]
    assert out.tokens == plain.tokens == lone.tokens
    s = out.stats
    assert s.draft_forwards > 0 and s.tree_nodes - s.context_nodes > 0          # head-drafted nodes
    assert (s.draft_forwards, s.tree_nodes, s.rounds) == (lone.stats.draft_forwards, lone.stats.tree_nodes,
                                                          lone.stats.rounds)   # the lone run's own trees
    assert s.batch_rounds == 0 and s.batch_exact is None and s.round_reason == "alone: the lone round"


def test_a_lone_request_hands_its_cache_to_its_slot_when_another_joins(eos_target):
    dec = _head_decoder(eos_target)
    prompts = [PROMPTS[0] * 3, PROMPTS[4], PROMPTS[2]]
    want = [dec.generate_baseline(p, max_new_tokens=30, ignore_eos=True).tokens for p in prompts]
    batch = BatchDecoder(dec, max_batch=3, prefill_tokens=5)
    first = batch.submit(prompts[0], max_new_tokens=30, ignore_eos=True)
    for _ in range(3):
        batch.step()
    assert first.lone and first.stats.rounds == 2 and first.stats.batch_rounds == 0
    others = [batch.submit(p, max_new_tokens=30, ignore_eos=True) for p in prompts[1:]]
    batch.step()
    assert not first.lone and first.stats.batch_rounds == 1 and batch.last_batch == 2   # beside a chunk
    while not batch.idle:
        batch.step()
    assert [r.output.tokens for r in [first] + others] == want
    s = first.output.stats
    assert s.draft_forwards > 0 and s.batch_rounds > 0 and s.round_reason.startswith("alone: the lone round, then")
    assert all(r.output.stats.draft_forwards == 0 for r in others)


# ---------------------------------------------------------------------------------------------- review gaps


@pytest.mark.parametrize("act8", [False, True])
def test_on_the_native_layers_chunked_prompts_beside_tree_blocks_give_the_lone_logits_bit_for_bit(
        tmp_path, monkeypatch, act8):
    """Slot 0 verifies a tree while slot 1's prompt goes in chunks beside it: the tree's logits are its
    lone verify's, and the prompt's last row its lone prefill's (one forward of the whole prompt)."""
    with _on_native_q4(tmp_path, monkeypatch, act8) as model:
        first, second = torch.tensor([3, 4, 5, 6, 7, 8, 9]), torch.tensor([20 + i for i in range(11)])
        tokens = torch.tensor([10, 11, 12, 13, 14])                       # root, two children, a grandchild each
        parents = torch.tensor([-1, 0, 0, 1, 2])
        allowed = torch.zeros(5, 5, dtype=torch.bool)
        for i in range(5):
            j = i
            while j >= 0:
                allowed[i, j], j = True, int(parents[j])
        positions = first.numel() + torch.tensor([0, 1, 1, 2, 2])
        lone = CachedLM(model, lean=True)
        with torch.inference_mode():
            lone.reset()
            lone.extend(first)
            want_tree = lone.forward(tokens, positions, allowed)
            lone.reset()
            want_prompt = lone.extend(second, last_logits=True)[-1]
            forward = SlotForward(lone.lean_forward(), model)
            assert forward.lean.native_layers() is not None
            cache = SlotCache.for_model(forward.lean, 2)
            forward(cache, [Block(0, first, torch.arange(first.numel()), causal_allowed(first.numel()),
                                  last_only=True, prompt_rows=first.numel())])
            chunks = [(0, 4), (4, 8), (8, 11)]
            for k, (a, b) in enumerate(chunks):
                blocks = [Block(1, second[a:b], torch.arange(a, b), causal_allowed(b - a), last_only=True,
                                prompt_rows=second.numel())]
                if k == 1:                                                  # the tree beside the middle chunk
                    blocks.insert(0, Block(0, tokens, positions, allowed))
                got = forward(cache, blocks)
                if k == 1:
                    assert torch.equal(got[0], want_tree)
        assert torch.equal(got[-1][-1], want_prompt)


def test_the_int4_kernels_dense_or_4bit_choice_is_each_prompts_not_the_batchs(target, monkeypatch):
    """On torch's int4 kernel a prefill of `PREFILL_ROWS` rows or more reads the dense weights: a long
    prompt's chunks do (as its lone prefill does), a short prompt and a tree beside them do not, however
    many rows the round has in all."""
    import contextlib
    calls = []

    @contextlib.contextmanager
    def forward_rows(model, rows, cached):
        calls.append((rows, quant.starts_dense(rows, cached)))
        yield

    monkeypatch.setattr(quant, "starts_dense", lambda rows, cached: cached == 0 and rows >= quant.PREFILL_ROWS)
    monkeypatch.setattr(quant, "forward_rows", forward_rows)
    lm = CachedLM(target, lean=True)
    forward = SlotForward(lm.lean_forward(), target)
    cache = SlotCache.for_model(forward.lean, 3)
    long = torch.tensor([(3 + i) % 50 + 2 for i in range(quant.PREFILL_ROWS + 8)])
    short = torch.tensor([9, 10, 11, 12, 13])
    with torch.inference_mode():
        forward(cache, [Block(2, short[:3], torch.arange(3), causal_allowed(3), True, 3)])
        blocks = [Block(0, long[:16], torch.arange(16), causal_allowed(16), True, long.numel()),
                  Block(1, short, torch.arange(5), causal_allowed(5), True, short.numel()),
                  Block(2, torch.tensor([4, 5]), torch.tensor([3, 4]), causal_allowed(2))]
        calls.clear()
        mixed = forward(cache, blocks)
        # two forwards: the long prompt's chunk on the dense weights (as its lone prefill of all its rows),
        # the short prompt and the tree beside it on the 4-bit ones
        assert sorted(calls) == [(7, False), (long.numel(), True)]
        calls.clear()
        rest = forward(cache, [Block(0, long[16:], torch.arange(16, long.numel()), causal_allowed(long.numel() - 16),
                                     True, long.numel())])
        assert calls == [(long.numel(), True)]                            # its later chunk dense too
    lone = CachedLM(target, lean=True)
    with torch.inference_mode():
        lone.reset()
        want = lone.extend(short, last_logits=True)[-1]
        lone.reset()
        want_long = lone.extend(long, last_logits=True)[-1]
    assert torch.allclose(mixed[1][-1], want, atol=1e-6, rtol=0) and torch.allclose(rest[0][-1], want_long, atol=1e-5)


def test_each_slot_is_given_its_own_drafting_time_not_the_rounds(eos_target, monkeypatch):
    """A fake clock that only proposals move: slot i's proposal takes i + 1 seconds; each request's
    draft_s sums its own proposals' seconds (and its policy hears its own)."""
    import mcsd.decoding.batch as batch_module
    from mcsd.decoding.propose import Proposer
    now = [0.0]
    monkeypatch.setattr(batch_module, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: now[0])}))
    seconds: dict = {}
    heard: dict = {}
    propose, observe = Proposer.propose, Proposer.observe

    def timed_propose(self, *args, **kwargs):
        now[0] += seconds.get(id(self), 0.0)
        return propose(self, *args, **kwargs)

    def heard_observe(self, proposal, acc, hidden, last, draft_ms, verify_ms, forward_ms=None, context=None):
        heard.setdefault(id(self), []).append(draft_ms)
        return observe(self, proposal, acc, hidden, last, draft_ms, verify_ms, forward_ms, context)

    monkeypatch.setattr(Proposer, "propose", timed_propose)
    monkeypatch.setattr(Proposer, "observe", heard_observe)
    batch = BatchDecoder(_decoder(eos_target), max_batch=3)
    requests = [batch.submit(p, max_new_tokens=12, ignore_eos=True) for p in PROMPTS[:3]]
    for i, r in enumerate(requests):
        seconds[id(r.proposer)] = i + 1.0
    while not batch.idle:
        batch.step()
    for i, r in enumerate(requests):
        rounds = r.output.stats.rounds
        assert rounds > 1 and r.output.stats.draft_s == pytest.approx((i + 1.0) * rounds)
        assert heard[id(r.proposer)] == [pytest.approx((i + 1.0) * 1000)] * rounds


def test_on_torchs_int4_kernel_in_bfloat16_a_long_prompt_runs_dense_beside_short_ones_and_no_answer_is_promised(
        q4_gguf_file, tmp_path, monkeypatch):
    """A batch over a bfloat16 q4 model on torch's int4 kernel: in the round where a long prompt's chunk
    and short prompts feed together, the long one's rows read the dense weights (as its lone prefill
    does, where oneDNN runs bfloat16) and only the short ones' go through the int4 product; every
    answer says it is not guaranteed its lone run's."""
    from mcsd.drafting.pair import load_model
    from mcsd.forward import kernels
    monkeypatch.setenv("MCSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MCSD_NATIVE", "0")
    native.reset()
    monkeypatch.setattr(native, "_state", {})
    if quant.kernel_name() != "torch":
        pytest.skip("this torch has no CPU int4 kernel")
    model = load_model(str(q4_gguf_file), dtype="bfloat16", weights="q4")
    dec = TreeDecoder(model, ContextDrafter(), attention="sdpa", calibrate=False, threads=None)
    batch = BatchDecoder(dec, max_batch=3)
    assert not batch.exact
    long = [(7 * i + 3) % 61 for i in range(quant.PREFILL_ROWS + 8)]
    requests = [batch.submit(p, max_new_tokens=6, ignore_eos=True) for p in ([3, 4, 5], long, [9, 10])]
    real, rows = torch.ops.aten._weight_int4pack_mm_for_cpu, []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant.torch.ops.aten, "_weight_int4pack_mm_for_cpu",
                   lambda *a: rows.append(a[0].shape[0]) or real(*a), raising=False)
        batch.step()                                        # the three prompts in one round
    assert batch.last_batch == 3
    if kernels.switchable(torch.bfloat16, "cpu"):
        assert set(rows) == {5}                             # the short prompts' rows alone on the codes
    while not batch.idle:
        batch.step()
    assert [len(r.output.tokens) for r in requests] == [6] * 3
    assert all(r.output.stats.batch_exact is False for r in requests)
