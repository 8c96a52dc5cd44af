"""EAGLE-3 heads: the library's own logits (fixtures made by `speculators`, tools/make_eagle3_fixtures.py),
lossless greedy and sampled drafting, export to both layouts, and bad heads refused in one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_follows_target, tiny_llama

from mcsd import TreeDecoder
from mcsd.core.tree import DraftTree, TreeTopology
from mcsd.drafting.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, eagle3_layout
from mcsd.drafting.pair import load_eagle3_drafter
from mcsd.errors import ModelLoadError

FIXTURES = Path(__file__).parent / "fixtures" / "eagle3"
# original-ids: the original head, its layers named by SGLang's eagle_config ids out of order
LAYOUTS = ["speculators", "speculators-qwen3", "original", "original-ids"]
PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])


def made_as(layout: str) -> str:
    """The head in logits.safetensors that `layout`'s folder holds."""
    return "original" if layout == "original-ids" else layout


@pytest.fixture(scope="module")
def fixture_target():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(FIXTURES / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def library():
    from safetensors.torch import load_file
    return load_file(FIXTURES / "logits.safetensors")


def chain(root: int, tokens: list[int]) -> DraftTree:
    """A chain tree: the root, then one node a level with `tokens`."""
    tree = DraftTree.root_only(TreeTopology.from_spec(",".join("1" * len(tokens))), torch.tensor(root))
    for depth, tok in enumerate(tokens, 1):
        tree.append_level(torch.tensor([tok]), torch.tensor([depth - 1]), torch.zeros(1), torch.tensor([depth]))
    return tree


# ------------------------------------------------------------------ the library's logits

@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_are_recognised(layout):
    assert eagle3_layout(FIXTURES / layout) == ("original" if layout.startswith("original") else "speculators")
    assert eagle3_layout(FIXTURES / "target") is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_target_states_are_the_ones_the_library_read(fixture_target, library, layout):
    """The target layers the loaded head names, read by the engine's forward, are the hidden states the
    library's forward was given (so the layer ids mean the same in both)."""
    from mcsd.forward.lm import CachedLM
    drafter = load_eagle3_drafter(str(FIXTURES / layout), fixture_target, "float32")
    lm = CachedLM(fixture_target)
    lm.reset()
    seq = library["sequence"]
    _, states = lm.extend(seq[:-1], hidden=drafter.feature_layers)
    assert torch.allclose(states, library[f"{made_as(layout)}.hidden"], atol=1e-5)


def engine_capture(folder: Path, n_layers: int) -> list[int]:
    """The transformers `hidden_states` indices vLLM or SGLang hand a head's fc, in the order they concatenate
    them, worked out from the config file by the engines' rules (not by mcsd's reader):
    - speculators (vLLM): `eagle_aux_hidden_state_layer_ids` name layers whose input is captured (its Llama
      forward appends hidden_states + residual before running layer idx): transformers' hidden_states[idx];
    - original (SGLang): `set_eagle3_layers_to_capture` adds 1 to each eagle_config id before the same
      capture, so id i is hidden_states[i + 1]; without ids, layers 2, L // 2, L - 3.
    Both capture in one pass over the layers, so the states come in layer order."""
    cfg = json.loads((folder / "config.json").read_text())
    if "speculators_model_type" in cfg:
        captured = cfg["eagle_aux_hidden_state_layer_ids"]
    else:
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        captured = [i + 1 for i in ids] if ids else [2, n_layers // 2, n_layers - 3]
    return [layer for layer in range(n_layers) if layer in captured]


def _with_config(layout: str, tmp_path: Path, **changes) -> Path:
    """A copy of fixture `layout` with config.json keys changed (None: removed)."""
    dest = tmp_path / f"{layout}-changed"
    shutil.copytree(FIXTURES / layout, dest)
    cfg = json.loads((dest / "config.json").read_text())
    for key, value in changes.items():
        cfg.pop(key, None) if value is None else cfg.__setitem__(key, value)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


@pytest.mark.parametrize("layout", LAYOUTS + ["speculators-unsorted"])
def test_the_drafter_is_fed_the_states_the_engines_capture(fixture_target, tmp_path, layout):
    """During a generation, the states the decoder hands the drafter are, position by position, the target
    states vLLM (speculators) or SGLang (original) would fuse for that config, computed here from
    transformers' `output_hidden_states` and the config's ids alone (so the fixture script's choice of states
    for an id plays no part). speculators-unsorted lists the speculators head's ids as [6, 1, 4]."""
    folder = _with_config("speculators", tmp_path, eagle_aux_hidden_state_layer_ids=[6, 1, 4]) \
        if layout == "speculators-unsorted" else FIXTURES / layout
    n_layers = fixture_target.config.num_hidden_layers
    with torch.no_grad():
        states = fixture_target(PROMPT[None], output_hidden_states=True).hidden_states    # (L+1) x (1, T, H)
    want = torch.cat([states[i][0] for i in engine_capture(folder, n_layers)], dim=-1)  # (T, 3H)
    drafter = load_eagle3_drafter(str(folder), fixture_target, "float32")
    fed = []
    observe = drafter.observe_target
    drafter.observe_target = lambda hidden: (fed.append(hidden.detach().clone()), observe(hidden))[1]
    TreeDecoder(fixture_target, drafter, tree="2,2", policy="static", attention="sdpa").generate(
        PROMPT, max_new_tokens=4)
    got = torch.cat(fed)[:PROMPT.numel()]                   # the prompt's positions, first committed
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5), layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_drafter_gives_the_library_logits_first_and_chained(fixture_target, library, layout):
    """At every position: the first step (begin_round) and two chained steps (tree steps down a chain,
    the teacher-forced tokens the library fed) equal the library's logits within 1e-4."""
    drafter = load_eagle3_drafter(str(FIXTURES / layout), fixture_target, "float32")
    made = made_as(layout)
    seq, hidden, want = library["sequence"], library[f"{made}.hidden"], library[f"{made}.logits"]
    T = hidden.shape[0]
    padded = torch.cat([seq, torch.zeros(2, dtype=torch.long)])      # the library feeds 0 past the end
    for q in range(T):
        drafter.reset()
        drafter.observe_target(hidden[:q + 1])
        got = [drafter.begin_round(seq[:q + 2])]
        tree = chain(int(seq[q + 1]), [int(padded[q + 2]), int(padded[q + 3])])
        for depth in (1, 2):
            got.append(drafter.step(tree, torch.tensor([depth]))[0])
        for k in range(3):
            assert (got[k] - want[k, q]).abs().max() < 1e-4, (layout, q, k)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_forward_gives_the_library_logits(fixture_target, library, layout):
    """The head's transformers-cache forward (what training runs), unrolled as the library's forward is,
    over the whole sequence at once."""
    from transformers import DynamicCache
    drafter = load_eagle3_drafter(str(FIXTURES / layout), fixture_target, "float32")
    made = made_as(layout)
    head, seq, want = drafter.head, library["sequence"], library[f"{made}.logits"]
    T = want.shape[1]
    cache, feats = DynamicCache(), head.fused(library[f"{made}.hidden"])[None]
    with torch.no_grad():
        for k in range(3):
            ids = torch.cat([seq[1 + k:], torch.zeros(k, dtype=torch.long)])
            allowed = torch.cat([torch.ones(T, T, dtype=torch.bool).tril()] + [torch.eye(T, dtype=torch.bool)] * k, 1)
            mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
            feats = head(feats, drafter.embed(ids)[None], torch.arange(1 + k, T + 1 + k)[None], mask, cache)
            assert (head.sub_scores(feats)[0] - want[k]).abs().max() < 1e-4, (layout, k)


@pytest.mark.parametrize("layout,reads", [("speculators", True), ("original", False)])
def test_a_config_without_norm_before_residual_reads_as_its_engine_reads_it(fixture_target, library, tmp_path,
                                                                              layout, reads):
    """vLLM's speculators config reader defaults the flag to true; SGLang's layer never reads it (false), nor
    does vLLM's default for a flat config. The speculators fixture was made with it true, the original one
    with it false: without the key, each still gives the library's logits."""
    folder = _with_config(layout, tmp_path, norm_before_residual=None)
    assert "norm_before_residual" not in json.loads((folder / "config.json").read_text())
    drafter = load_eagle3_drafter(str(folder), fixture_target, "float32")
    assert drafter.head.cfg.norm_before_residual is reads
    drafter.observe_target(library[f"{layout}.hidden"])
    assert (drafter.begin_round(library["sequence"]) - library[f"{layout}.logits"][0, -1]).abs().max() < 1e-4


def test_layer_ids_out_of_order_are_fused_in_layer_order(fixture_target, library, tmp_path):
    """vLLM concatenates the captured states in layer order, so a speculators config listing [6, 1, 4] is
    the head made for 1, 4, 6; it drafts the library's logits from the target's own states."""
    from mcsd.forward.lm import CachedLM
    folder = _with_config("speculators", tmp_path, eagle_aux_hidden_state_layer_ids=[6, 1, 4])
    drafter = load_eagle3_drafter(str(folder), fixture_target, "float32")
    assert drafter.feature_layers == (1, 4, 6)
    lm = CachedLM(fixture_target)
    lm.reset()
    _, states = lm.extend(library["sequence"][:-1], hidden=drafter.feature_layers)
    drafter.observe_target(states)
    assert (drafter.begin_round(library["sequence"]) - library["speculators.logits"][0, -1]).abs().max() < 1e-4


def test_repeated_layer_ids_and_unordered_configs_are_refused(fixture_target, tmp_path):
    folder = _with_config("speculators", tmp_path, eagle_aux_hidden_state_layer_ids=[1, 4, 4])
    with pytest.raises(ModelLoadError, match=r"layer ids \[1, 4, 4\] with repeats") as exc:
        load_eagle3_drafter(str(folder), fixture_target, "float32")
    _one_line(exc)
    layer = json.loads((FIXTURES / "speculators" / "config.json").read_text())["transformer_layer_config"]
    with pytest.raises(ValueError, match="distinct and ascending"):
        Eagle3Config(hidden=32, vocab_size=96, draft_vocab=96, layer_config=layer, aux_layers=(4, 1, 6))


def test_a_head_storing_a_copy_of_the_target_embedding_embeds_with_the_target(fixture_target):
    drafter = load_eagle3_drafter(str(FIXTURES / "speculators"), fixture_target, "float32")
    assert drafter.head.embed_tokens is None and drafter.embed is fixture_target.get_input_embeddings()


def test_load_model_pair_reads_an_eagle3_folder(fixture_target, tmp_path):
    from mcsd import load_model_pair
    shutil.copytree(FIXTURES / "target", tmp_path / "target")
    from conftest import word_tokenizer
    word_tokenizer(vocab=96).save_pretrained(tmp_path / "target")
    target, drafter, _ = load_model_pair(str(tmp_path / "target"), str(FIXTURES / "original"), dtype="float32")
    assert isinstance(drafter, Eagle3Drafter) and drafter.feature_layers == (2, 4, 5)   # EAGLE-3's default for 8
    ref = TreeDecoder(target, None, attention="sdpa").generate_baseline(PROMPT, max_new_tokens=24).tokens
    assert TreeDecoder(target, drafter, tree="3,2,1", policy="static", attention="sdpa").generate(
        PROMPT, max_new_tokens=24).tokens == ref


# ------------------------------------------------------------------ lossless drafting

def random_eagle3(target, aux=(0, 1, 3), draft_vocab=0, norm_before_residual=False, seed=5, kind="llama"):
    """A random EAGLE-3 head for `target` (norms away from 1); draft_vocab > 0: a random draft vocabulary."""
    torch.manual_seed(seed)
    tc = target.config
    layer = dict(model_type=kind, hidden_size=tc.hidden_size, intermediate_size=48, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=tc.hidden_size // 4,
                 max_position_embeddings=256, rms_norm_eps=1e-6, vocab_size=tc.vocab_size, rope_theta=10000.0)
    cfg = Eagle3Config(hidden=tc.hidden_size, vocab_size=tc.vocab_size, draft_vocab=draft_vocab or tc.vocab_size,
                       layer_config=layer, aux_layers=aux, norm_before_residual=norm_before_residual)
    head = Eagle3Head(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
        if draft_vocab:
            ids = torch.randperm(tc.vocab_size)[:draft_vocab].sort().values
            head.d2t.copy_(ids - torch.arange(draft_vocab))
    return head


@pytest.fixture(scope="module")
def deep_target():
    return tiny_llama(4, layers=4)


@pytest.fixture(scope="module")
def deep_reference(deep_target):
    return TreeDecoder(deep_target, None, attention="sdpa").generate_baseline(PROMPT, max_new_tokens=48).tokens


@pytest.mark.parametrize("spec", ["1,1,1", "4,2,2"])
@pytest.mark.parametrize("draft_vocab", [0, 24])
def test_random_eagle3_head_is_lossless_greedy(deep_target, deep_reference, spec, draft_vocab):
    drafter = Eagle3Drafter(random_eagle3(deep_target, draft_vocab=draft_vocab), deep_target)
    out = TreeDecoder(deep_target, drafter, tree=spec, policy="static", attention="sdpa").generate(
        PROMPT, max_new_tokens=48)
    assert out.tokens == deep_reference
    assert out.stats.draft_forwards > 0


@pytest.mark.parametrize("policy", ["heuristic", "auto"])
def test_eagle3_head_under_other_policies_is_lossless(deep_target, deep_reference, policy, fresh_cache):
    head = random_eagle3(deep_target, draft_vocab=24, norm_before_residual=True, kind="qwen3")
    out = TreeDecoder(deep_target, Eagle3Drafter(head, deep_target), policy=policy, attention="sdpa").generate(
        PROMPT, max_new_tokens=48)
    assert out.tokens == deep_reference


def test_eagle3_head_with_context_drafting_is_lossless(deep_target, deep_reference):
    from mcsd.drafting.context import ContextDrafter
    drafter = Eagle3Drafter(random_eagle3(deep_target, draft_vocab=24), deep_target)
    dec = TreeDecoder(deep_target, [drafter, ContextDrafter()], tree="3,2", policy="static", attention="sdpa")
    assert dec.generate(PROMPT, max_new_tokens=48).tokens == deep_reference


def test_sampling_with_an_eagle3_head_is_exact():
    from mcsd.config import SamplingConfig
    small = tiny_llama(10, vocab=8, layers=3, sharpness=6.0, hidden=16)
    drafter = Eagle3Drafter(random_eagle3(small, aux=(0, 1, 2), draft_vocab=5, seed=2), small)
    dec = TreeDecoder(small, drafter, tree="3,2", policy="static", attention="sdpa")
    assert_follows_target(dec, small, SamplingConfig(1.0), n=1200)


def test_sampling_with_top_p_and_an_eagle3_head_is_exact():
    from mcsd.config import SamplingConfig
    small = tiny_llama(11, vocab=8, layers=3, sharpness=4.0, hidden=16)
    drafter = Eagle3Drafter(random_eagle3(small, aux=(0, 1, 2), seed=3, norm_before_residual=True), small)
    dec = TreeDecoder(small, drafter, tree="2,2", policy="static", attention="sdpa")
    assert_follows_target(dec, small, SamplingConfig(0.8, top_p=0.9), n=1200)


def test_bfloat16_pair_converts_with_its_head(fixture_target):
    import copy
    from mcsd.drafting.pair import cast_pair
    target = copy.deepcopy(fixture_target)
    drafter = load_eagle3_drafter(str(FIXTURES / "original"), target, "float32")
    target, drafter = cast_pair(target, drafter, "bfloat16")
    assert isinstance(drafter, Eagle3Drafter) and drafter.head.fc.weight.dtype == torch.bfloat16
    out = TreeDecoder(target, drafter, tree="2,2", policy="static", attention="sdpa").generate(PROMPT, max_new_tokens=8)
    assert len(out.tokens) == 8


# ------------------------------------------------------------------ bad heads: one line

def _one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_mismatched_head_and_target_are_refused(fixture_target, tmp_path):
    other_vocab = tiny_llama(3, vocab=64, layers=8, hidden=32)
    with pytest.raises(ModelLoadError, match="vocabulary of 96; the target has 64") as exc:
        load_eagle3_drafter(str(FIXTURES / "speculators"), other_vocab, "float32")
    _one_line(exc)
    wider = tiny_llama(3, vocab=96, layers=8, hidden=48)
    with pytest.raises(ModelLoadError, match="hidden size 32; the target has 48") as exc:
        load_eagle3_drafter(str(FIXTURES / "original"), wider, "float32")
    _one_line(exc)
    shallow = tiny_llama(3, vocab=96, layers=5, hidden=32)
    with pytest.raises(ModelLoadError, match=r"reads target layers \[1, 4, 6\]; the target has 5 layers") as exc:
        load_eagle3_drafter(str(FIXTURES / "speculators"), shallow, "float32")
    _one_line(exc)


def _copy(layout, tmp_path) -> Path:
    dest = tmp_path / layout
    shutil.copytree(FIXTURES / layout, dest)
    return dest


@pytest.mark.parametrize("layout", ["speculators", "original"])
def test_truncated_or_malformed_heads_are_refused(fixture_target, tmp_path, layout):
    d = _copy(layout, tmp_path)
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="weights are unreadable") as exc:
        load_eagle3_drafter(str(d), fixture_target, "float32")
    _one_line(exc)
    weights.unlink()
    with pytest.raises(ModelLoadError, match="no EAGLE-3 head weights") as exc:
        load_eagle3_drafter(str(d), fixture_target, "float32")
    _one_line(exc)
    shutil.rmtree(d)
    d = _copy(layout, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    if layout == "speculators":
        del cfg["transformer_layer_config"]
        match = "config is malformed"
    else:
        cfg["num_attention_heads"] = 3                       # the weights no longer fit the config
        match = "draft layer config is not usable|do not match its config"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match) as exc:
        load_eagle3_drafter(str(d), fixture_target, "float32")
    _one_line(exc)


def test_missing_weights_and_unsupported_options_are_refused(fixture_target, tmp_path):
    from safetensors.torch import load_file, save_file
    d = _copy("original", tmp_path)
    state = load_file(d / "model.safetensors")
    del state["fc.weight"], state["d2t"], state["t2d"]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="no d2t") as exc:
        load_eagle3_drafter(str(d), fixture_target, "float32")
    _one_line(exc)
    d = _copy("speculators", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["norm_output"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="option norm_output is not supported") as exc:
        load_eagle3_drafter(str(d), fixture_target, "float32")
    _one_line(exc)


def test_cli_exits_2_with_one_line_for_a_mismatched_head(model_dirs, capsys):
    from mcsd.cli import main
    code = main(["--target", str(model_dirs / "target"), "--draft", str(FIXTURES / "speculators"),
                 "--dtype", "float32", "--prompt", "w03"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "vocabulary of 96; the target has 64" in err, err


# ------------------------------------------------------------------ export and training

def _same_scores(a: Eagle3Head, b: Eagle3Head, feats_width: int):
    """Both heads give the same draft scores over the whole vocabulary on a random block."""
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(0)
    states = torch.randn(1, 5, feats_width, generator=g)
    embeds = torch.randn(1, 5, a.cfg.hidden, generator=g)
    pos = torch.arange(1, 6)[None]
    with torch.no_grad():
        outs = [h.scores(h(h.fused(states), embeds, pos, None, DynamicCache())) for h in (a, b)]
    assert torch.equal(a.vocab_ids, b.vocab_ids) and torch.allclose(outs[0], outs[1], atol=1e-6)


@pytest.mark.parametrize("aux", [(1, 2, 3), (0, 1, 3)])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_export_writes_both_layouts_and_reads_them_back(deep_target, tmp_path, aux, norm_before_residual):
    from mcsd.train.eagle3_export import write_original, write_speculators
    head = random_eagle3(deep_target, aux=aux, draft_vocab=24, norm_before_residual=norm_before_residual)
    embed = deep_target.get_input_embeddings().weight
    write_speculators(head, tmp_path / "spec", "tiny-target", embed, card={"note": "test"})
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["norm_before_residual"] is norm_before_residual
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(aux)
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "tiny-target"
    drafter = load_eagle3_drafter(str(tmp_path / "spec"), deep_target, "float32")
    _same_scores(head, drafter.head, 3 * head.cfg.hidden)
    if norm_before_residual:                      # SGLang's layer would take the residual before the norm
        with pytest.raises(ValueError, match="SGLang would run it as another network") as exc:
            write_original(head, tmp_path / "orig", target_layers=4)
        _one_line(exc)
        assert not (tmp_path / "orig").exists()
        return
    if 0 in aux:                                  # SGLang's ids name layer outputs: layer 0's input has none
        with pytest.raises(ValueError, match="cannot name"):
            write_original(head, tmp_path / "orig", target_layers=4)
        return
    write_original(head, tmp_path / "orig", target_layers=4)
    cfg = json.loads((tmp_path / "orig" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in aux]
    assert eagle3_layout(tmp_path / "orig") == "original"
    assert "norm_before_residual" not in cfg
    back = load_eagle3_drafter(str(tmp_path / "orig"), deep_target, "float32")
    assert back.feature_layers == aux and not back.head.cfg.norm_before_residual
    _same_scores(head, back.head, 3 * head.cfg.hidden)


@pytest.mark.parametrize("source", ["original", "original-ids"])
def test_export_tool_converts_a_library_head_both_ways(fixture_target, library, tmp_path, source):
    """A head the library made in the original layout, rewritten in the speculators layout by the tool and
    back again, still gives the library's logits at each stage (its layers in layer order in both)."""
    from mcsd.train.eagle3_export import main
    hidden, want = library["original.hidden"], library["original.logits"]
    for layout, folder in (("speculators", FIXTURES / source), ("original", tmp_path / "speculators")):
        assert main([str(folder), str(tmp_path / layout), "--layout", layout,
                     "--target", str(FIXTURES / "target")]) == 0
        assert eagle3_layout(tmp_path / layout) == layout
        drafter = load_eagle3_drafter(str(tmp_path / layout), fixture_target, "float32")
        assert drafter.feature_layers == (2, 4, 5) and not drafter.head.cfg.norm_before_residual
        drafter.observe_target(hidden)
        assert (drafter.begin_round(library["sequence"]) - want[0, -1]).abs().max() < 1e-4
    spec = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and spec["norm_before_residual"] is False


def test_export_tool_refuses_a_norm_before_residual_head_for_sglang(tmp_path):
    """The library's speculators head was made with norm_before_residual: the original layout would have
    SGLang run it as another network, so the tool says so in one line and writes nothing."""
    from mcsd.train.eagle3_export import main
    with pytest.raises(SystemExit, match="norm_before_residual, which SGLang's EAGLE-3 layer ignores") as exc:
        main([str(FIXTURES / "speculators"), str(tmp_path / "out"), "--layout", "original",
              "--target", str(FIXTURES / "target")])
    assert "\n" not in str(exc.value) and not (tmp_path / "out").exists()


def test_export_refuses_what_the_original_layout_cannot_hold(deep_target, tmp_path):
    from mcsd.train.eagle3_export import write_original
    layer = dict(random_eagle3(deep_target).cfg.layer_config, num_hidden_layers=2)
    two = Eagle3Head(Eagle3Config(hidden=32, vocab_size=64, draft_vocab=64, layer_config=layer, aux_layers=(1, 2, 3)))
    with pytest.raises(ValueError, match="one draft layer, not 2"):
        write_original(two, tmp_path / "x", target_layers=4)


def test_trainer_writes_an_eagle3_head_that_drafts_losslessly(tmp_path, monkeypatch):
    """tools/train_feature_drafter.py --arch eagle3: a few updates on stored target layers, written in the
    speculators layout, read back by --draft's loader, drafting exactly."""
    from conftest import word_tokenizer
    from mcsd.train import data as td
    from mcsd.train import engine
    from mcsd.train import feature_head as tfd
    monkeypatch.setenv("MCSD_CACHE", str(tmp_path / "cache"))
    target = tiny_llama(0, layers=4)
    target.save_pretrained(tmp_path / "target")
    word_tokenizer().save_pretrained(tmp_path / "target")
    data = tmp_path / "data"
    for run, n, seed in (("fit", 8, 1), ("held", 2, 2)):
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(3, 64, (4,), generator=g).tolist() for _ in range(n)]
        outs = engine.generate_batch(target, prompts, max_new_tokens=16, eos_ids=(1,), pad_id=0, topk=4)
        td.start_run(data, "runs", run, {"split": "fit" if run == "fit" else "heldout"})
        td.save_shard(data, "runs", run, [{"key": f"{run}-{i}/0", "prompt_id": f"{run}-{i}", "category": "qa",
                                           "prompt": torch.tensor(p, dtype=torch.int32), **o}
                                          for i, (p, o) in enumerate(zip(prompts, outs))], {"n_sequences": n})
        engine.main(["--target", str(tmp_path / "target"), "--data-dir", str(data), "--threads", "1",
                     "teacher", run, "--store-layers", "1,2,3"])
    out = tmp_path / "head"
    assert tfd.main(["--target", str(tmp_path / "target"), "--data-dir", str(data), "--runs", "fit",
                     "--heldout-run", "held", "--window", "16", "--sub-vocab", "40", "--max-updates", "3",
                     "--threads", "1", "--arch", "eagle3", "--feature-layers", "1,2,3", "--verifier", "org/tiny",
                     "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] <= 40
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    card = json.loads((out / "card.json").read_text())
    assert card["architecture"]["kind"] == "EAGLE-3 draft head" and len(card["heldout_agreement"]) == 3
    drafter = load_eagle3_drafter(str(out), target, "float32")
    ref = TreeDecoder(target, None, attention="sdpa").generate_baseline(PROMPT, max_new_tokens=24).tokens
    assert TreeDecoder(target, drafter, tree="3,2", policy="static", attention="sdpa").generate(
        PROMPT, max_new_tokens=24).tokens == ref
    assert cfg["norm_before_residual"] is False and not drafter.head.cfg.norm_before_residual
    for bad in ("1,2", "3,1,2"):                  # two layers; three out of the order the engines fuse them in
        with pytest.raises(SystemExit, match="three distinct target layers .* in ascending order"):
            tfd.main(["--target", str(tmp_path / "target"), "--data-dir", str(data), "--runs", "fit",
                      "--arch", "eagle3", "--feature-layers", bad, "--out", str(tmp_path / "bad")])


def test_cli_drafts_with_an_eagle3_folder(tmp_path, capsys):
    from conftest import word_tokenizer
    from mcsd.cli import main
    shutil.copytree(FIXTURES / "target", tmp_path / "target")
    word_tokenizer(vocab=96).save_pretrained(tmp_path / "target")
    common = ["--target", str(tmp_path / "target"), "--dtype", "float32", "--prompt", "w03 w17 w42",
              "--max-new-tokens", "12", "--json"]
    assert main(common + ["--baseline"]) == 0
    want = json.loads(capsys.readouterr().out)["tokens"]
    assert main(common + ["--draft", str(FIXTURES / "original"), "--policy", "static", "--tree", "2,2"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == want
