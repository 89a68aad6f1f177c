"""Sequence parallelism matrix (a one-off check, not CI): Llama, Qwen3, Mistral (sliding window), GPT-2 (learned
positions, tied head), Mixtral and Qwen3-MoE (mixture of experts, router loss on) and Gemma 2 (logit soft-capping,
sliding and full layers) trained with HybridParallelPlugin(sp_size=2, enable_sequence_parallelism=True,
sequence_parallelism_mode="ring_attn" | "all_to_all") composed with tp, pp and dp + ZeRO-1, against one process,
with tests/model_utils.check_training (2 AdamW steps: the loss, every gradient, every parameter after each step, at
1e-5, fp32) on rows of 16 tokens, plain (right padding on one row), nopad (no attention mask at all: the ring's own
causal blocks) and packed (booster_plugin.packing: 2 to 4 whole
documents per row, position_ids restarting at 0, no attention mask, models with use_cache=False so that transformers
keeps attention inside each document).

Tiny models (4 layers, hidden 32, vocabulary 100): Llama 8 heads / 4 kv heads; Qwen3 8 / 4 with q/k norms;
Mistral 8 / 4 with sliding_window=4 (smaller than the 16-token row and than a rank's part of it, so the window
crosses the ring's chunk boundaries); GPT-2 4 heads, learned absolute positions, tied input/output embeddings;
Mixtral and Qwen3-MoE 8 / 4, 4 experts top-2, output_router_logits=True, router_aux_loss_coef=1; Gemma 2 8 / 4,
attn_logit_softcapping=1 (most scores capped hard), sliding_window=4 on alternate layers, eager attention.

Layouts (sp, tp, pp, dp) and ranks:
  sp2            2 ranks: sp 2
  sp2 x tp2      4 ranks: sp 2, tp 2
  sp2 x pp2      4 ranks: sp 2, 2 stages, 2 microbatches
  sp2 x dp2 Z1   4 ranks: sp 2, dp 2, zero_stage=1

    python benchmarks/sp_matrix.py [--only llama,gpt2] [--modes ring_attn] [--layouts sp2,sp2_tp2] [--data plain]

check_training builds its batches with tests/model_utils.make_batch (8 tokens): the ranks of this script replace
that function (monkeypatched in the rank process, tests/ unchanged) with 16-token batches. Writes
benchmarks/results/context_sp_matrix.json and docs/context_parallel.md (the matrix).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

OUT = os.path.join(HERE, "results", "context_sp_matrix.json")
DOC = os.path.join(ROOT, "docs", "context_parallel.md")
LENGTH = 16  # tokens per row (a multiple of 2 * sp * tp for every layout here)
WINDOW = 4  # Mistral's sliding window
DOCS_PER_ROW = (2, 4)  # whole documents per packed row
MODELS = {"llama": "Llama", "qwen3": "Qwen3", "mistral": "Mistral (window 4)", "gpt2": "GPT-2",
          "mixtral": "Mixtral (MoE, router loss)", "qwen3moe": "Qwen3-MoE (router loss)",
          "gemma2": "Gemma 2 (soft-cap 1, window 4)"}
MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=1.0)
MODES = ("ring_attn", "all_to_all")
DATA = ("plain", "nopad", "packed")
# name: (label, world size, plugin keywords besides the sp ones)
LAYOUTS = {
    "sp2": ("sp2 (2 ranks)", 2, {}),
    "sp2_tp2": ("sp2 x tp2 (4 ranks)", 4, {"tp_size": 2}),
    "sp2_pp2": ("sp2 x pp2, m=2 (4 ranks)", 4, {"pp_size": 2, "num_microbatches": 2}),
    "sp2_dp2_zero1": ("sp2 x dp2, ZeRO-1 (4 ranks)", 4, {"zero_stage": 1}),
}


# -- models and batches (registered on the ranks) --------------------------------------------------------------------
def _config_kwargs(packed: bool) -> dict:
    return dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_attention_heads=8, num_key_value_heads=4,
                max_position_embeddings=64, pad_token_id=0, attention_dropout=0.0, use_cache=not packed)


def build_model(model: str, packed: bool, layers: int = 4):
    import transformers
    from tests import model_utils as mu
    kw = _config_kwargs(packed)
    if model == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=layers, **kw))
    if model == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_hidden_layers=layers, head_dim=8, **kw))
    if model == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(num_hidden_layers=layers, head_dim=4,
                                                                          sliding_window=WINDOW, **kw))
    if model == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(num_hidden_layers=layers, head_dim=4,
                                                                          num_local_experts=4, **MOE, **kw))
    if model == "qwen3moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_hidden_layers=layers, head_dim=8, num_experts=4, moe_intermediate_size=32, **MOE, **kw))
    if model == "gemma2":
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            num_hidden_layers=layers, head_dim=4, attn_logit_softcapping=1.0, sliding_window=WINDOW, **kw))
    if model == "gpt2":
        config = mu.gpt2_config(layers)
        config.n_positions, config.use_cache = 64, not packed
        return transformers.GPT2LMHeadModel(config)  # tie_word_embeddings=True (GPT-2's default)
    raise KeyError(model)


def kind_name(model: str, data: str) -> str:
    """The kind registered in tests.model_utils.MODELS ('_packed' in the name: packed rows; '_lm': labels)."""
    return f"spm_{model}_{data}_lm"


def register(model: str, data: str) -> str:
    from tests import model_utils as mu
    kind = kind_name(model, data)
    mu.MODELS[kind] = lambda n=4: build_model(model, data == "packed", n)
    return kind


def documents(seed: int):
    """An endless stream of documents planned so that pack_documents fills each LENGTH-token row with DOCS_PER_ROW
    whole documents (2 to 4, chosen at random per row) and sometimes a free tail of up to 3 padding tokens: a row's
    documents are at least 2 tokens long and its first at least 4 (it never fits into the previous row's tail)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    while True:
        k = rand(*DOCS_PER_ROW)
        total = LENGTH - rand(0, 3)
        lengths = [4] + [2] * (k - 1)
        for _ in range(total - sum(lengths)):  # the remaining tokens to random documents of the row
            lengths[rand(0, k - 1)] += 1
        for n in lengths:
            yield [int(t) for t in torch.randint(1, 100, (n,), generator=g)]


def make_batch(kind: str, batch_size: int, seed: int):
    """tests.model_utils.make_batch at LENGTH tokens: packed rows for '_packed' kinds, else tokens with 3 padding
    tokens on the right of the first row (attention_mask) and labels masked there."""
    import torch
    from booster_plugin.packing import pack_documents
    if "_packed" in kind:
        return next(pack_documents(documents(seed), LENGTH, pad_token_id=0, rows_per_batch=batch_size))
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, 100, (batch_size, LENGTH), generator=g)
    if "_nopad" in kind:  # no attention_mask: sdpa's mask function returns None (plain causal) unless a window cuts
        return {"input_ids": input_ids, "labels": input_ids.clone()}
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, -3:] = 0
    input_ids[0, -3:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": input_ids.masked_fill(attention_mask == 0, -100)}


def docs_per_row(batch) -> list:
    """Whole documents per packed row (position_ids restarting at 0), the free tail's padding document excluded."""
    out = []
    for pos, labels in zip(batch["position_ids"], batch["labels"]):
        starts = (pos == 0).nonzero().flatten().tolist() + [len(pos)]
        out.append(sum(1 for a, b in zip(starts, starts[1:]) if (labels[a:b] != -100).any()))
    return out


class Refused(Exception):
    """The plugin refused the layout (ValueError / NotImplementedError), with its reason."""


def cell(model: str, mode: str, layout: str, data: str) -> None:
    """On every rank: check_training of `model` under `layout` and `mode` on `data` rows (raises on the first
    mismatch; a refusal is re-raised as Refused with the plugin's message)."""
    from torch.nn.modules import module as nn_module
    from tests import model_utils as mu
    kind = register(model, data)
    lengths, seen = [], set()

    def batch(kind, batch_size, seed):
        out = make_batch(kind, batch_size, seed)
        lengths.append(out["input_ids"].shape[1])
        return out

    def layer_input(module, args):  # the sequence length each decoder layer runs on
        if type(module).__name__.endswith(("DecoderLayer", "Block")) and args and hasattr(args[0], "shape"):
            seen.add(args[0].shape[1])

    def prepare(plugin):
        assert plugin.sp_mode == mode and plugin.ctx.sp.size == 2, (plugin.sp_mode, plugin.ctx.sp.size)

    mu.make_batch = batch  # check_training reads the module global: 16-token rows
    kwargs = dict(LAYOUTS[layout][2], sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode=mode)
    hook = nn_module.register_module_forward_pre_hook(layer_input)
    try:
        mu.check_training(kind, steps=2, prepare=prepare, **kwargs)
    except (ValueError, NotImplementedError) as error:
        raise Refused(f"{type(error).__name__}: {error}") from error
    finally:
        hook.remove()
    # the check ran on LENGTH-token rows, the reference on whole rows, the boosted layers on half of them
    assert lengths and set(lengths) == {LENGTH}, lengths
    assert LENGTH in seen and LENGTH // 2 in seen, f"decoder layers ran on sequence lengths {sorted(seen)}"


# -- further checks (each in both modes): options and inputs the matrix does not vary ---------------------------------
def _extra_builder(model: str, packed: bool, **config):
    """A builder like build_model's with config fields changed."""
    import transformers
    kw = {**_config_kwargs(packed), **config}
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 8}),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"head_dim": 4})}
    config_class, model_class, extra = classes[model]
    return lambda n=4: model_class(config_class(num_hidden_layers=n, **{**extra, **kw}))


def _short_documents(kind: str, batch_size: int, seed: int):
    """Packed rows of documents of 1 to 3 tokens (single-token documents: queries whose only key is themselves)."""
    import torch
    from booster_plugin.packing import pack_documents
    g = torch.Generator().manual_seed(seed)

    def docs():
        while True:
            n = int(torch.randint(1, 4, (1,), generator=g))
            yield [int(t) for t in torch.randint(1, 100, (n,), generator=g)]
    return next(pack_documents(docs(), LENGTH, rows_per_batch=batch_size))


def _left_padded(kind: str, batch_size: int, seed: int):
    """Rows 0 and 1 padded on the left (5 and 9 tokens: queries without any key), labels masked there."""
    import torch
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (batch_size, LENGTH), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[1, :9] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _eval_then_train(mode: str) -> None:
    """Eval-mode loss and greedy generate() under sp equal one process; training mode splits (and is exact) again."""
    import copy
    import torch
    from booster_plugin import Booster, HybridParallelPlugin
    from tests import model_utils as mu
    kind = register("llama", "plain")
    reference = mu.build(kind).eval()
    plugin = HybridParallelPlugin(sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode=mode)
    model, *_ = Booster(plugin=plugin).boost(copy.deepcopy(reference))
    model.eval()
    batch = make_batch(kind, 4, 0)
    with torch.no_grad():
        mu.assert_close(model(**batch).loss, reference(**batch).loss, "eval loss")
        prompt = batch["input_ids"][:1, :5]
        out = model.unwrap().generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
        assert torch.equal(out, reference.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)), out
    model.train()
    reference.train()
    mu.assert_close(model(**batch).loss.detach(), reference(**batch).loss.detach(), "training loss after eval")


# name: (description, world size, model, data, builder config or None, batch function or None, plugin keywords)
EXTRAS = {
    "checkpointing": ("activation checkpointing of every layer, Llama, packed, sp2", 2, "llama", "packed", None,
                      None, {"gradient_checkpoint_config": "all"}),
    "sp4_window3": ("sp4 (4 ranks: chunks of 2 tokens), Mistral sliding_window=3, packed", 4, "mistral", "packed",
                    {"sliding_window": 3}, None, {"sp_size": 4}),
    "short_documents": ("packed rows of 1- to 3-token documents, Llama, sp2", 2, "llama", "packed", None,
                        _short_documents, {}),
    "clipping_tp2": ("clipping max_norm=0.05, GPT-2, plain, sp2 x tp2", 4, "gpt2", "plain", None, None,
                     {"tp_size": 2, "max_norm": 0.05}),
    "zero2_clipping": ("ZeRO-2 + clipping max_norm=0.05, Qwen3, packed, sp2 x dp2", 4, "qwen3", "packed", None, None,
                       {"zero_stage": 2, "max_norm": 0.05}),
    "bf16": ("bf16 (tolerance 3e-2, reference fp32), Mistral window 4, plain, sp2", 2, "mistral", "plain", None, None,
             {"precision": "bf16", "tol": 3e-2}),
    "eager": ("attn_implementation='eager', Llama, plain, sp2", 2, "llama", "plain",
              {"attn_implementation": "eager"}, None, {}),
    "mixed_layers": ("Qwen3 alternating sliding (window 5) and full layers, packed, sp2", 2, "qwen3", "packed",
                     {"use_sliding_window": True, "sliding_window": 5,
                      "layer_types": ["sliding_attention", "full_attention"] * 2}, None, {}),
    "left_padding_tp2": ("left padding (rows without any key), Llama, sp2 x tp2", 4, "llama", "plain", None,
                         _left_padded, {"tp_size": 2}),
    "eval_generate": ("eval-mode loss and greedy generate() equal one process, then training, Llama, sp2", 2,
                      "llama", "plain", None, None, {}),
    "mixtral_ep2": ("Mixtral, router loss, plain, sp2 x ep2 (dp 2 = ep 2: experts dispatched from the shards)", 4,
                    "mixtral", "plain", None, None, {"ep_size": 2}),
    "qwen3moe_ep2": ("Qwen3-MoE, router loss, packed, sp2 x ep2 (dp 2 = ep 2)", 4, "qwen3moe", "packed", None, None,
                     {"ep_size": 2}),
}


def extra(name: str, mode: str) -> None:
    """On every rank: the further check `name` in `mode` (raises on the first mismatch)."""
    if name == "eval_generate":
        return _eval_then_train(mode)
    from booster_plugin.core.activation_checkpoint import GradientCheckpointConfig
    from tests import model_utils as mu
    _, _, model, data, config, batch_fn, plugin_kwargs = EXTRAS[name]
    kind = register(model, data)
    if config is not None:
        mu.MODELS[kind] = _extra_builder(model, data == "packed", **config)
    mu.make_batch = batch_fn or make_batch
    kwargs = dict(plugin_kwargs)
    if kwargs.get("gradient_checkpoint_config") == "all":
        kwargs["gradient_checkpoint_config"] = GradientCheckpointConfig(gradient_checkpointing_ratio=1.0)
    kwargs.setdefault("sp_size", 2)
    try:
        mu.check_training(kind, steps=2, enable_sequence_parallelism=True, sequence_parallelism_mode=mode, **kwargs)
    except (ValueError, NotImplementedError) as error:
        raise Refused(f"{type(error).__name__}: {error}") from error
    finally:
        mu.MODELS.pop(kind, None)  # (the matrix registers its own builder again)


def first_error(message: str) -> str:
    """The exception line (and the mismatch summary of assert_close) of the first failing rank's traceback."""
    lines = [line for line in message.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith("--- rank"):
            block = []
            for nxt in lines[i + 1:]:
                if nxt.startswith("--- rank"):
                    break
                block.append(nxt)
            refused = [b for b in block if "Refused:" in b]
            if refused:
                return refused[-1].split("Refused: ", 1)[1][:400]
            for j, b in enumerate(block):
                if b.startswith("AssertionError"):
                    detail = " ".join(x.strip() for x in block[j:j + 4] if not x.startswith("  File"))
                    return detail[:400]
            errors = [b for b in block if not b.startswith(" ") and ("Error" in b or "Exception" in b)]
            return (errors[-1] if errors else block[-1])[:400] if block else line
    return lines[0][:400] if lines else "failed"


# -- one process: do the models keep attention inside each packed document? -----------------------------------------
def isolation_check(model: str) -> str:
    """The one-process model on a packed row vs each document alone: 'isolated' if every document's logits match
    (the precondition of the packed rows being meaningful), else the largest difference."""
    import torch
    torch.manual_seed(0)
    net = build_model(model, packed=True).eval()
    batch = make_batch(kind_name(model, "packed"), 1, 5)
    with torch.no_grad():
        packed = net(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        pos = batch["position_ids"][0]
        starts = (pos == 0).nonzero().flatten().tolist() + [LENGTH]
        worst = 0.0
        for a, b in zip(starts, starts[1:]):
            alone = net(input_ids=batch["input_ids"][:, a:b]).logits[0]
            worst = max(worst, (alone - packed[a:b]).abs().max().item())
    return "isolated" if worst < 1e-5 else f"NOT isolated (max |diff| {worst:.2e})"


def window_check() -> str:
    """Does Mistral's sliding window change the one-process output on these rows (else the column tests nothing)?"""
    import torch
    torch.manual_seed(0)
    net = build_model("mistral", packed=False).eval()
    batch = make_batch(kind_name("mistral", "plain"), 2, 3)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        windowed = net(**inputs).logits
        net.config.sliding_window = None
        full = net(**inputs).logits
    diff = (windowed - full).abs().max().item()
    return f"sliding_window={WINDOW} vs none: max |logit diff| {diff:.2e}" + (" (no effect!)" if diff < 1e-6 else "")


# -- report ------------------------------------------------------------------------------------------------------------
def column(mode: str, data: str) -> str:
    return f"{mode}, {data}"


def render(matrix: dict) -> str:
    cols = [column(m, d) for d in DATA for m in MODES]
    out = []
    for layout, (label, world, _) in LAYOUTS.items():
        out.append(f"\n**{label}**\n")
        out.append("| model | " + " | ".join(cols) + " |")
        out.append("|---|" + "---|" * len(cols))
        for model, name in MODELS.items():
            cells = []
            for c in cols:
                r = matrix["results"].get(name, {}).get(label, {}).get(c)
                cells.append("—" if r is None else (r["result"] if r["result"] == "pass" else
                                                     f"**{r['result']}**: {r.get('detail', '')}"))
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def summary_counts(matrix: dict) -> dict:
    counts: dict = {}
    for by_layout in matrix["results"].values():
        for by_col in by_layout.values():
            for r in by_col.values():
                counts[r["result"]] = counts.get(r["result"], 0) + 1
    return counts


def write_doc(matrix: dict) -> None:
    counts = summary_counts(matrix)
    failures = [(m, l, c, r) for m, bl in matrix["results"].items() for l, bc in bl.items() for c, r in bc.items()
                if r["result"] != "pass"]
    lines = [
        "# Sequence parallelism over its own group (`sp_size`): exactness matrix",
        "",
        "A one-off run of `python benchmarks/sp_matrix.py` (not in CI; raw results in "
        "`benchmarks/results/context_sp_matrix.json`). Each cell trains a tiny model 2 AdamW steps with "
        "`HybridParallelPlugin(sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode=...)` in the "
        "given layout and compares it with the unsharded model on one process (`tests/model_utils.check_training`): "
        "the loss, every gradient the optimizer steps (gathered over tp / ZeRO) and every parameter after each step, "
        "at 1e-5 (rtol and atol), fp32.",
        "",
        f"- Rows of {LENGTH} tokens, local batch 8 per dp replica. **plain**: random tokens, the first row with 3 "
        "padding tokens on the right (`attention_mask`, labels masked). **nopad**: random tokens, no `attention_mask` (sdpa's mask function then returns no mask "
        "for a plain causal row: ring attention runs its own causal blocks; Mistral's window still builds a mask). "
        "**packed**: "
        f"`booster_plugin.packing.pack_documents` rows of {DOCS_PER_ROW[0]} to {DOCS_PER_ROW[1]} whole documents of "
        "random lengths of at least 2 tokens (a free tail of up to 3 tokens is one padding document), "
        "`position_ids` restarting at 0, no attention mask, each document's first label masked; the packed models "
        "have `use_cache=False`, so transformers keeps attention inside each document.",
        "- Models (4 layers, hidden 32, vocabulary 100): Llama (8 heads, 4 kv heads), Qwen3 (8/4, q/k norms), "
        f"Mistral (8/4, `sliding_window={WINDOW}`: smaller than the row and than a rank's part of it, so the window "
        "crosses the ring's zigzag chunks), GPT-2 (4 heads, learned absolute positions, tied head), Mixtral and "
        "Qwen3-MoE (8/4, 4 experts top-2, the router's load-balancing loss on: `output_router_logits=True`, "
        "`router_aux_loss_coef=1`), Gemma 2 (8/4, `attn_logit_softcapping=1` so that most scores are capped, "
        f"`sliding_window={WINDOW}` on alternate layers, eager attention).",
        "- Layouts: sp2 on 2 ranks; sp2 x tp2, sp2 x pp2 (1F1B, 2 microbatches), sp2 x dp2 with ZeRO-1 on 4 ranks "
        "(mesh `(dp, pp, sp, tp)`).",
        "- One process isolates the packed documents (each document's logits in the packed row equal the document "
        "alone): " + ", ".join(f"{MODELS[m]}: {v}" for m, v in matrix.get("isolation", {}).items()) + ". "
        "Mistral's window matters on these rows (one process, " + matrix.get("window_effect", "not checked") + ").",
        "",
        f"**Result: {counts.get('pass', 0)} pass, {counts.get('refused', 0)} refused, {counts.get('fail', 0)} fail** "
        f"(of {sum(counts.values())} cells).",
    ]
    if failures:
        lines += ["", "Not passing:", ""]
        lines += [f"- {m}, {l}, {c}: **{r['result']}** — {r.get('detail', '')}" for m, l, c, r in failures]
    lines += ["", "## Matrix", render(matrix), "", matrix.get("note", ""), ""]
    if matrix.get("extras"):
        lines += ["## Further checks", "",
                  "The same comparison (`check_training`, 2 AdamW steps, 1e-5 unless stated) for options and inputs the "
                  "matrix does not vary (`EXTRAS` in the script):", "",
                  "| check | ranks | ring_attn | all_to_all |", "|---|---|---|---|"]
        for description, by_mode in matrix["extras"].items():
            world = next((e[1] for e in EXTRAS.values() if e[0] == description), "")
            cells = [by_mode.get(m, {}).get("result", "—") + (f": {by_mode[m]['detail']}" if by_mode.get(m, {}).get(
                "detail") else "") for m in MODES]
            lines.append(f"| {description} | {world} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += render_benchmarks()
    os.makedirs(os.path.dirname(DOC), exist_ok=True)
    with open(DOC, "w") as f:
        f.write("\n".join(lines))


def render_benchmarks() -> list:
    """The figures of benchmarks/bench_context.py (benchmarks/results/context*.json), if it was run."""
    path = os.path.join(HERE, "results", "context.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        r = json.load(f)
    env = r.get("env", {})
    mib = 2 ** 20
    out = ["## Memory and speed (`benchmarks/bench_context.py`)", "",
           f"`OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 benchmarks/bench_context.py` (outside CI; "
           f"`benchmarks/results/context.json`): Llama hidden 256, 2 layers, 4 heads, ffn 1024, vocabulary "
           f"{r['model']['vocab_size']}, fp32, one row of L tokens, gloo on a shared {env.get('cpu_count')}-core CPU "
           f"machine (load average {env.get('loadavg_at_start')} at start, {r.get('loadavg_at_end')} at end), one "
           "thread per rank, torch " + str(env.get("torch")) + ", transformers " + str(env.get("transformers")) + ".",
           "", "**Activations per rank** (peak of the bytes saved for backward in one forward+backward, "
           "`bench_memory.SavedTensorMeter`; sp=2: the larger rank). Target sp=2 <= 0.55x sp=1.", "",
           "| L | sp=1 MiB | ring_attn MiB | ring/sp=1 | all_to_all MiB | a2a/sp=1 |", "|---|---|---|---|---|---|"]
    act = r["activations"]
    for length in act["sp=1"]:
        ring, a2a = act["ring_attn"][length], act["all_to_all"][length]
        out.append(f"| {length} | {act['sp=1'][length]['activations_peak_max'] / mib:.1f} | "
                   f"{ring['activations_peak_max'] / mib:.1f} | {ring['ratio_to_sp1']:.3f} | "
                   f"{a2a['activations_peak_max'] / mib:.1f} | {a2a['ratio_to_sp1']:.3f} |")
    other = os.path.join(HERE, "results", "context_vocab32000.json")
    if os.path.exists(other):
        with open(other) as f:
            big = json.load(f)["activations"]
        ratios = {mode: ", ".join(f"L={k}: {v['ratio_to_sp1']:.3f}" for k, v in big[mode].items())
                  for mode in ("ring_attn", "all_to_all")}
        out += ["", f"With a vocabulary of 32000 (`--vocab 32000 --name context_vocab32000`, "
                f"`benchmarks/results/context_vocab32000.json`) the ratio is {ratios['ring_attn']} (ring_attn), "
                f"{ratios['all_to_all']} (all_to_all): the LM head, the logits and the loss run on each rank's tokens "
                "(`shardformer/sequence/loss.py`), so they are split over sp too."]
    out += ["", "**Longest measured power-of-two length whose activations fit a per-rank budget**", "",
            "| budget | sp=1 | ring_attn | all_to_all |", "|---|---|---|---|"]
    for budget, v in r["longest_length_under_activation_budget"].items():
        out.append(f"| {budget} | {v['sp=1']} | {v['ring_attn']} | {v['all_to_all']} |")
    if "speed" in r:
        sp = r["speed"]
        out += ["", f"**Training step** (forward + backward + AdamW) at L={sp['length']}, all variants in one run, "
                f"{sp['rounds']} interleaved rounds in rotated order, medians. sp=1 is one process on one core doing the "
                "whole sequence (the other rank idles in a barrier: its CPU time is ~0); sp=2 uses two processes, one "
                "core each. `x sp=1 (cpu)`: sp=1's CPU seconds per step over the busier sp rank's, what the wall-time "
                "ratio approaches on idle cores. Target ring_attn >= 1.3x sp=1." +
                (f" {sp['note']}" if sp.get("note") else ""), "",
                "| variant | median s | tokens/s | x sp=1 (medians) | x sp=1 (paired) | CPU s rank 0 / 1 | x sp=1 (cpu) |",
                "|---|---|---|---|---|---|---|"]
        for name, v in sp["variants"].items():
            if name == "comparisons":
                continue
            out.append(f"| {name} | {v['median_s']:.2f} | {v['tokens_per_s']:.0f} | {v['speedup_vs_sp1_1thread']:.2f} | "
                       f"{v.get('paired_speedup_vs_sp1_1thread', float('nan')):.2f} | {v['cpu_s_per_step_rank0']:.2f} / "
                       f"{v['cpu_s_per_step_rank1']:.2f} | {v.get('cpu_speedup_vs_sp1_1thread', float('nan')):.2f} |")
        out += [""] + [f"- {c['text']}" for c in sp["variants"]["comparisons"].values()]
    cp = r.get("torch_context_parallel")
    if cp:
        out += ["", f"**torch's context parallel** (`torch.distributed.tensor.experimental.context_parallel`, torch "
                f"{cp['torch']}, {cp['device_mesh']}, L={cp['length']}):", ""]
        for label, a in cp["attempts"].items():
            out.append(f"- {label}: " + (f"`{a['error']}`" if a["result"] == "error" else
                                         f"ran, loss {a['loss']:.6f}, matches sp=1: {a['loss_matches']}"))
    return out + ["", "## Findings", ""] + FINDINGS + [""]


FINDINGS = [
    "- **Head and loss on each rank's tokens** (`shardformer/sequence/loss.py`). With an sp group of its own, a "
    "training forward with labels runs `lm_head`, the logits and the model's causal-LM loss on each rank's tokens: "
    "the span's end still gathers the hidden states (the model's code after the final norm sees one process's shapes, "
    "e.g. GPT-2's view), the head takes this rank's tokens again (a copy: the gathered tensor is not kept for "
    "backward), the labels are shifted on the full sequence and the token losses are summed over sp. Before, every sp "
    "rank ran the head and the loss on the whole gathered sequence: the ratio was 0.572 at vocabulary 1024 and 0.859 "
    "at vocabulary 32000 (now: the table and the vocabulary-32000 sentence above).",
    "- The excess over half of sp=1 (+20 MiB per rank at L=16384, both modes) is the attention's: a new output tensor "
    "per layer for `o_proj` (all_to_all's exchange back; ring attention's output relayout) and, with ring_attn, the "
    "saved scaled queries and packed key/value copy in place of sdpa's q, k, v. 476.5 (half of sp=1) + 20 = 496.5 "
    "MiB, the measured 496.8 (ring_attn) and 496.6 (all_to_all).",
    "- **ring_attn's blocks run in torch's fused CPU attention kernel** (`shardformer/sequence/ring_blocks.py`: "
    "`_scaled_dot_product_flash_attention_for_cpu` and its backward, which return / take the log-sum-exp; diagonal "
    "blocks as is_causal, so their upper triangle is not computed; masked blocks with an additive mask; each block's "
    "backward with the final output and log-sum-exp, so the blocks' gradients sum to the exact total). Before, its "
    "blocks were hand-written eager ops on fp32 score tiles (`aten::bmm` 560 calls per step, `exp_`, `masked_fill_`), "
    "diagonal blocks computed whole then masked: 1.28x sp=1 (CPU seconds 1.33x) on a quiet machine (2026-11-25) "
    "against all_to_all's 1.84x. They stay as the fallback (devices without a fused kernel in `ring_blocks.FUSED`, "
    "i.e. CUDA today; eager's rows without any key; key and value head dims that differ) and run as the variant "
    "`ring_attn sp=2 hand-written blocks` with `--ring-fallback`: in the run above (a quiet machine, load 1.7) the "
    "fused blocks take 0.62x the hand-written ones' time (paired median, faster in 7 of 7 rounds), ring_attn reaches "
    "1.66x sp=1 at L=8192 (hand-written blocks: 0.99x on this machine, whose one process is ~1.2x slower than the "
    "2026-11-25 one's) against all_to_all's 1.78x.",
    "- **Mixture of experts** (`shardformer/expert/router_logits.py`, `sequence_parallel.py`). The MoE layers run on each "
    "rank's tokens (under ep the exchange dispatches the shard's tokens), so each router sees only those; the "
    "load-balancing loss multiplies per-expert token fractions by mean router probabilities over all tokens (padding "
    "excluded by the full attention mask), which no sum of per-shard losses gives. Where the span gathers the "
    "sequence back, the recorded router logits of every layer are gathered over sp in token order (zigzag for "
    "ring_attn), so the model's own loss function sees one process's logits on every sp rank; the gather's backward "
    "hands each rank its tokens' gradient and the router and expert weights are summed over sp like every layer "
    "weight (under ep the experts are split before those sums are hooked, on the kept experts). One all-gather of "
    "[tokens, experts] per MoE layer and microbatch. Without the gather the aux loss fails on padded rows (shape) "
    "and differs on packed ones; with ep, hooking the sums before the split left the expert gradients unsummed "
    "(92.8% of Mixtral's gate_up_proj gradient off).",
    "- **Gemma 2's logit soft-capping under ring_attn** (`shardformer/sequence/ring_blocks.py`): the scaled scores become "
    "cap * tanh(scores / cap) before the mask, in the hand-written blocks (torch's fused kernels cannot cap); their "
    "backward recomputes the capped scores and multiplies the scores' gradient by 1 - tanh(scores / cap)^2. Without "
    "that factor the kernel test's gradients differ in 95% of the elements.",
    "- torch's own `context_parallel` does not run on CPU (errors above): its SDPA dispatch handles the CUDA "
    "flash / efficient / cudnn ops only; `aten._scaled_dot_product_flash_attention_for_cpu` has no DTensor sharding "
    "strategy, and the math backend mixes DTensor and plain tensors.",
]


def print_table(matrix: dict) -> None:
    cols = [column(m, d) for d in DATA for m in MODES]
    rows = []
    for model, name in MODELS.items():
        for layout, (label, _, _) in LAYOUTS.items():
            row = [name, label]
            for c in cols:
                r = matrix["results"].get(name, {}).get(label, {}).get(c)
                row.append("-" if r is None else r["result"])
            rows.append(row)
    headers = ["model", "layout"] + cols
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    fmt = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    print(fmt(headers))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(fmt(r))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated models: " + ",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--data", default=",".join(DATA))
    parser.add_argument("--extras", default=",".join(EXTRAS), help="further checks: " + ",".join(EXTRAS))
    parser.add_argument("--no-extras", action="store_true")
    parser.add_argument("--render", action="store_true", help="only rewrite the doc from the JSON results")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one cell may take")
    args = parser.parse_args()
    import torch
    torch.set_num_threads(1)
    import sp_matrix  # this module by name: the ranks unpickle `sp_matrix.cell`, not `__main__.cell`
    from tests.dist_utils import run_distributed

    models = [m for m in args.only.split(",") if m] or list(MODELS)
    modes = [m for m in args.modes.split(",") if m]
    layouts = [t for t in args.layouts.split(",") if t]
    datas = [d for d in args.data.split(",") if d]
    matrix = {"results": {}, "isolation": {}}
    if os.path.exists(OUT):  # keep the cells not run this time
        with open(OUT) as f:
            old = json.load(f)
        matrix.update({k: v for k, v in old.items() if k in ("results", "isolation", "extras", "window_effect",
                                                             "documents_per_packed_row", "note")})
    if args.render:
        write_doc(matrix)
        print(f"wrote {DOC}")
        return
    sample = make_batch("x_packed_lm", 64, 0)
    per_row = docs_per_row(sample)
    print(f"packed rows: {min(per_row)}-{max(per_row)} documents per row (64 sample rows)", flush=True)
    for model in models:
        matrix["isolation"][model] = isolation_check(model)
        print(f"{MODELS[model]}: one process on packed rows: {matrix['isolation'][model]}", flush=True)
    matrix["window_effect"] = window_check()
    print(f"Mistral, one process: {matrix['window_effect']}", flush=True)
    start = time.time()
    for layout in layouts:  # world sizes grouped: the rank pools are reused
        label, world, _ = LAYOUTS[layout]
        for data in datas:
            for mode in modes:
                for model in models:
                    t0 = time.time()
                    try:
                        run_distributed(world, sp_matrix.cell, model, mode, layout, data, timeout=args.timeout)
                        result = {"result": "pass"}
                    except AssertionError as error:
                        detail = first_error(str(error))
                        result = {"result": "refused" if "Refused:" in str(error) else "fail", "detail": detail}
                    result["seconds"] = round(time.time() - t0, 1)
                    matrix["results"].setdefault(MODELS[model], {}).setdefault(label, {})[column(mode, data)] = result
                    print(f"{MODELS[model]:20s} {label:28s} {column(mode, data):22s} {result['result']} "
                          f"{result.get('detail', '')} ({result['seconds']} s)", flush=True)
    for name in ([] if args.no_extras else [e for e in args.extras.split(",") if e]):
        description, world = EXTRAS[name][:2]
        for mode in modes:
            t0 = time.time()
            try:
                run_distributed(world, sp_matrix.extra, name, mode, timeout=args.timeout)
                result = {"result": "pass"}
            except AssertionError as error:
                result = {"result": "refused" if "Refused:" in str(error) else "fail",
                          "detail": first_error(str(error))}
            result["seconds"] = round(time.time() - t0, 1)
            matrix.setdefault("extras", {}).setdefault(description, {})[mode] = result
            print(f"extra: {description:80s} {mode:10s} {result['result']} {result.get('detail', '')} "
                  f"({result['seconds']} s)", flush=True)
    matrix["results"] = {MODELS[m]: matrix["results"][MODELS[m]] for m in MODELS if MODELS[m] in matrix["results"]}
    matrix["documents_per_packed_row"] = [min(per_row), max(per_row)]
    matrix["note"] = (f"transformers {_version('transformers')}, torch {_version('torch')}, gloo on a shared "
                      f"{os.cpu_count()}-core CPU machine, one thread per rank; last run "
                      f"{time.strftime('%Y-%m-%d %H:%M')} ({time.time() - start:.0f} s for the cells run).")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(matrix, f, indent=2)
    write_doc(matrix)
    print_table(matrix)
    print(f"wrote {OUT} and {DOC} ({time.time() - start:.0f} s)")


def _version(name: str) -> str:
    return __import__(name).__version__


if __name__ == "__main__":
    main()
