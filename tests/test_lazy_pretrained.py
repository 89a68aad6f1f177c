"""Lazy init as ColossalAI users write it: `with LazyInitContext(): model = AutoModelForCausalLM.from_pretrained(dir)`
builds the model on the meta device, remembering where each weight comes from; `boost` then reads each rank's shard
from the safetensors slices (or initializes it), and `LazyInitContext.materialize(model)` the whole model.

Checked against the model loaded normally: (a) tp=2 and pp=2 on 2 ranks, the parameters equal the eager model's
shards bit for bit and one training step equals the eager model's; (b) without a plugin, the materialized model
equals `from_pretrained`'s (dtype argument, missing keys, keyword config overrides, buffers); (c) tied embeddings
stay tied, before and after boost; (d) from a config (`Model(config)`, `from_config`), lazy init equals eager init
under the same seed, bit for bit, on every rank and layout (tp=2, pp=2 here; tp=2 x pp=2 in
tests/test_expert_parallel.py), leaves the script's RNG where eager init leaves it, and the first loss equals one
process's."""
import copy

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, LlamaModel, MixtralConfig

from hp_check.tiny import tiny_config

from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.colossalai.lazy import LazyInitContext
from tests import model_utils as mu
from tests.dist_utils import run_distributed


def _config(tie: bool) -> LlamaConfig:
    config = mu.llama_config(4)
    config.tie_word_embeddings = tie
    return config


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: directory} of save_pretrained checkpoints: a tiny Llama (untied, tied) and a base Llama (no head)."""
    root = tmp_path_factory.mktemp("lazy_pretrained")
    out = {}
    for name, build in (("untied", lambda: LlamaForCausalLM(_config(False))),
                        ("tied", lambda: LlamaForCausalLM(_config(True))),
                        ("base", lambda: LlamaModel(_config(False)))):
        torch.manual_seed(7)
        build().save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def _lazy(path: str, **kwargs):
    with LazyInitContext():
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers())), "lazy from_pretrained allocated weights"
    return model


def _assert_same(model, reference, what: str) -> None:
    """State dict and buffers (non-persistent ones too) equal, bit for bit, dtype included."""
    for kind, ours, theirs in (("tensor", model.state_dict(), reference.state_dict()),
                               ("buffer", dict(model.named_buffers()), dict(reference.named_buffers()))):
        assert ours.keys() == theirs.keys(), f"{what}: {kind} names differ"
        for name, t in ours.items():
            assert t.dtype == theirs[name].dtype and torch.equal(t, theirs[name]), f"{what}: {kind} {name} differs"


# -- (b) and (c) without a plugin ------------------------------------------------------------------------------------
def test_materialize_equals_from_pretrained(saved):
    for path, kwargs in ((saved["untied"], {}), (saved["tied"], {}), (saved["untied"], {"dtype": torch.bfloat16}),
                         (saved["untied"], {"torch_dtype": torch.float16, "rms_norm_eps": 1e-3})):
        reference = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        model = _lazy(path, **kwargs)
        assert not model.training and model.config.to_dict() == reference.config.to_dict(), kwargs
        params = list(model.parameters())  # e.g. in an optimizer built before materializing: still the model's
        assert LazyInitContext.materialize(model) is model
        assert all(p is q for p, q in zip(params, model.parameters()))
        _assert_same(model, reference, f"{path} {kwargs}")
    # (c) tied: one parameter before and after materialization, as from_pretrained makes it
    model = _lazy(saved["tied"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    LazyInitContext.materialize(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.is_meta


def test_truncated_file_is_named(saved, tmp_path):
    """A truncated safetensors file (an interrupted download): the error names the file and the fix."""
    import shutil
    copy_dir = tmp_path / "truncated"
    shutil.copytree(saved["untied"], copy_dir)
    weights = copy_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"checkpoint file {weights} is corrupted or truncated .*download it again"):
        _lazy(str(copy_dir))


def test_missing_keys_initialized_as_from_pretrained(saved):
    """A causal LM from a base model's checkpoint: the head is missing, reported as such and initialized by the
    model's own init (its draws differ from from_pretrained's); everything else equals from_pretrained's."""
    reference, expected = AutoModelForCausalLM.from_pretrained(saved["base"], output_loading_info=True)
    with LazyInitContext(default_device="cpu"):
        model, info = AutoModelForCausalLM.from_pretrained(saved["base"], output_loading_info=True)
    assert info["missing_keys"] == expected["missing_keys"] == {"lm_head.weight"}
    LazyInitContext.materialize(model)
    head, ref_head = model.lm_head.weight, reference.lm_head.weight
    std = model.config.initializer_range
    assert torch.isfinite(head).all() and abs(head.std().item() - std) < 0.3 * std and abs(head.mean()) < 0.2 * std
    model.lm_head.weight.data.copy_(ref_head)
    _assert_same(model, reference, "base checkpoint")


def test_context_as_colossalai(saved):
    with LazyInitContext():
        with pytest.raises(RuntimeError, match="not reentrant"):
            with LazyInitContext():
                pass
        built = LlamaForCausalLM(_config(False))
        from_config = AutoModelForCausalLM.from_config(_config(True))
    assert all(p.is_meta for p in built.parameters()) and all(p.is_meta for p in from_config.parameters())
    assert from_config.lm_head.weight is from_config.model.embed_tokens.weight
    LazyInitContext.materialize(from_config)
    assert not any(t.is_meta for t in (*from_config.parameters(), *from_config.buffers()))
    reference = AutoModelForCausalLM.from_pretrained(saved["untied"])  # the context is gone: eager again
    assert not any(p.is_meta for p in reference.parameters())


# -- (a) tp=2, pp=2 on 2 ranks ----------------------------------------------------------------------------------------
def _boost(model, tp: int, pp: int):
    plugin = HybridParallelPlugin(tp_size=tp, pp_size=pp, num_microbatches=2 if pp > 1 else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return plugin, booster, model, optimizer


def _step(plugin, booster, model, optimizer) -> None:
    batch = mu.on_device(mu.make_batch("llama_lm", 4, seed=dist.get_rank() // (plugin.tp_size * plugin.pp_size)))
    if plugin.pp_size > 1:
        booster.execute_pipeline(iter([batch]), model, mu.criterion, optimizer)
    else:
        booster.backward(mu.criterion(model(**batch), batch), optimizer)
    optimizer.step()
    optimizer.zero_grad()


def _check_layout(path: str, tp: int, pp: int, tied: bool) -> None:
    what = f"{path.rsplit('/', 1)[-1]} tp{tp} pp{pp}"
    reference = AutoModelForCausalLM.from_pretrained(path)
    eager = _boost(copy.deepcopy(reference), tp, pp)
    lazy = _boost(_lazy(path), tp, pp)
    group = lazy[0].tp_group if tp > 1 else None
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for (name, p), (eager_name, q) in zip(lazy[2].unwrap().named_parameters(), eager[2].unwrap().named_parameters()):
        assert name == eager_name and p.dtype == q.dtype and torch.equal(p, q), f"{what}: shard of {name} differs"
        assert torch.equal(mu.gathered(p, p.data, group).cpu(), ref_params[name]), f"{what}: {name} != from_pretrained"
    for (name, b), (_, c) in zip(lazy[2].unwrap().named_buffers(), eager[2].unwrap().named_buffers()):
        assert torch.equal(b, c), f"{what}: buffer {name} differs"
    if tied and pp == 1:
        hf = lazy[2].unwrap()
        assert hf.lm_head.weight is hf.model.embed_tokens.weight, f"{what}: tied embeddings untied by boost"
    for run in (eager, lazy):
        run[2].train()
        _step(*run)
    for (name, p), (_, q) in zip(lazy[2].unwrap().named_parameters(), eager[2].unwrap().named_parameters()):
        mu.assert_close(p, q, f"{what}: {name} after a step")


# -- (d) from a config: eager init's draws, each rank its slice ------------------------------------------------------
def _mixtral():
    """A tiny Mixtral from its config (39 tensors: attention, router, fused experts, norms, embedding, head)."""
    return AutoModelForCausalLM.from_config(tiny_config(MixtralConfig, num_local_experts=4, num_experts_per_tok=2))


def _eager_and_lazy(build, seed: int = 11, **context):
    """(built eagerly, built under LazyInitContext) from the same seed; the RNG is left as eager init leaves it."""
    torch.manual_seed(seed)
    reference = build()
    after = torch.get_rng_state()
    torch.manual_seed(seed)
    with LazyInitContext(**context):
        model = build()
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers())), "lazy init allocated weights"
    assert torch.equal(torch.get_rng_state(), after) or context, "the script's RNG differs from eager init's after it"
    return reference, model


def test_from_config_equals_eager_init():
    reference, model = _eager_and_lazy(_mixtral)
    rng = torch.get_rng_state()
    LazyInitContext.materialize(model)
    assert torch.equal(torch.get_rng_state(), rng), "materialize moved the script's RNG"
    _assert_same(model, reference, "Mixtral from_config")


def test_copy_inside_the_context_materializes_as_the_original():
    """ColossalAI's tests build a model and `copy.deepcopy` it under one LazyInitContext, materialize one and boost
    the other, then compare them: a copy's values are the original's (eager init's), not draws of its own."""
    torch.manual_seed(11)
    reference = _mixtral()
    torch.manual_seed(11)
    with LazyInitContext():
        model = _mixtral()
        copied = copy.deepcopy(model)
    LazyInitContext.materialize(copied)
    LazyInitContext.materialize(model)
    _assert_same(copied, reference, "deepcopy under LazyInitContext")
    _assert_same(model, reference, "the original of the copy")


class _TorchInits(torch.nn.Module):
    """torch's init functions that return at once on meta (trunc_normal_, orthogonal_, sparse_), a generator of the
    script's, factories with data (also onto a parameter's device) or draws, in-place edits of views, a dtype cast,
    torch's own modules."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin = torch.nn.Embedding(10, 6, padding_idx=2), torch.nn.Linear(6, 6)
        self.mha, self.conv = torch.nn.MultiheadAttention(6, 2), torch.nn.Conv1d(3, 4, 3)
        self.a, self.b, self.c = (torch.nn.Parameter(torch.empty(*shape)) for shape in ((4, 6), (5, 3), (6, 4)))
        torch.nn.init.trunc_normal_(self.a, std=0.5)
        torch.nn.init.orthogonal_(self.b)
        torch.nn.init.sparse_(self.c, 0.5)
        self.d = torch.nn.Parameter(torch.randn(3, 3))
        self.e = torch.nn.Parameter(torch.empty(7))
        torch.nn.init.normal_(self.e, generator=torch.Generator().manual_seed(5))
        self.register_buffer("k", torch.tensor([1.5, 2.5, 3.5]))
        self.register_buffer("r", torch.arange(6).float().reciprocal() * 2)
        with torch.no_grad():
            self.lin.weight[0].mul_(3)
            self.lin.bias.copy_(self.r)
            self.lin.bias[:2].copy_(torch.tensor([0.5, 1.5], device=self.lin.bias.device))  # (meta, in the context)
            self.emb.weight[3:5] = self.d[:2, :1]
        self.half = torch.nn.Linear(3, 3).to(torch.bfloat16)


def test_torch_init_functions_recorded():
    reference, model = _eager_and_lazy(_TorchInits)
    rng = torch.get_rng_state()
    LazyInitContext.materialize(model)
    assert torch.equal(torch.get_rng_state(), rng), "materialize moved the script's RNG"
    _assert_same(model, reference, "torch init functions")


def test_per_rank_init_opt_in():
    """Faster, and says so: each rank's own draws (not eager init's); the script's RNG is not advanced."""
    reference, model = _eager_and_lazy(_mixtral, per_rank_init=True)
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(11).get_state())
    LazyInitContext.materialize(model)
    head = model.lm_head.weight
    assert torch.isfinite(head).all() and not torch.equal(head, reference.lm_head.weight)


def check_from_config(tp: int, pp: int, **plugin) -> None:
    """Boosted at (tp, pp): every parameter's shard is eager init's slice, bit for bit; the first loss is one
    process's. Collective."""
    what = f"from_config tp{tp} pp{pp} {plugin}"
    reference, lazy = _eager_and_lazy(_mixtral)
    rng = torch.get_rng_state()
    booster = Booster(plugin=HybridParallelPlugin(tp_size=tp, pp_size=pp, num_microbatches=2 if pp > 1 else None,
                                                  **plugin))
    model, optimizer, *_ = booster.boost(lazy, torch.optim.AdamW(lazy.parameters(), lr=1e-3))
    assert torch.equal(torch.get_rng_state(), rng), f"{what}: boost moved the script's RNG"
    group = booster.plugin.tp_group if tp > 1 else None
    experts = model.info.expert_params
    ep_group = booster.plugin.ctx.ep.group if experts else None
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for name, p in model.unwrap().named_parameters():
        full = mu.gathered(p, p.data, group, ep_group if name in experts else None)
        assert torch.equal(full.cpu(), ref_params[name]), f"{what}: {name} differs from eager init"
    ref_buffers = dict(reference.named_buffers())
    for name, b in model.unwrap().named_buffers():  # (a released stage leaves a placeholder buffer)
        assert name not in ref_buffers or torch.equal(b.cpu(), ref_buffers[name]), f"{what}: buffer {name} differs"
    model.train()
    batch = mu.on_device(mu.make_batch("llama_lm", 4, seed=3))
    if pp > 1:
        loss = booster.execute_pipeline(iter([batch]), model, mu.criterion, optimizer, return_loss=True)["loss"]
    else:
        loss = mu.criterion(model(**batch), batch)
    if loss is not None:  # (pp: the last stage)
        mu.assert_close(loss.detach().cpu(), mu.microbatch_mean_loss(reference.train(), batch, 2 if pp > 1 else 4),
                        f"{what}: first loss")


def _layouts(paths) -> None:
    check_from_config(2, 1)
    check_from_config(1, 2)
    _check_layout(paths["untied"], 2, 1, tied=False)
    _check_layout(paths["tied"], 2, 1, tied=True)
    _check_layout(paths["tied"], 1, 2, tied=True)  # the tied embedding and head on different stages


def test_lazy_pretrained_boost(saved):
    run_distributed(2, _layouts, saved)
