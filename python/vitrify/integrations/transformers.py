"""A transformers causal LM served with a static KV cache and a decode CUDA-graph ladder, frozen and
thawed through :mod:`vitrify.session` (:class:`CausalLMEngine` is the adapter).

The model is a ``transformers`` Llama-style (or Qwen2-style) causal LM built from a config with
seeded random weights (no downloads). ``transformers`` defines it: at FREEZE the engine builds
the transformers model (on the meta device) and checks that its parameters are exactly
:func:`param_specs` (names, shapes, dtypes). The engine's tensors live in the region under those
names and its forward is functional over them (CPU-tested against the transformers model's own
forward), so THAW needs torch but not transformers, and the KV cache is one static tensor per
layer for every batch size:

- prefill (eager, the prompts in one right-padded batch, causal SDPA) writes each prompt's
  keys/values into its row;
- a decode step for batch ``bs`` reads ``tokens[:bs]`` and ``positions[:bs]``, writes the new
  keys/values at each row's position (``index_put_`` in place, also under ``torch.compile``),
  attends over the row's cache up to it (masked SDPA), and writes ``logits[:bs]`` and
  ``next_tokens[:bs]``; one CUDA graph per batch size of the ladder. The rotary embedding is
  written without ``torch.cat`` (see :func:`rotary`) so every decode graph stays relocatable.

``variant="compiled"`` runs the decode step through ``torch.compile`` (``dynamic=True``: one
compile serves every batch size; Inductor's Triton kernels end up in the graphs). THAW does not
compile: it replays the rebuilt graphs (only the fallback that re-runs warmup compiles again).
The rotary embedding's attention scaling is 1.0 for these configs (no rope scaling options).

Phases (see ``docs/session.md``): ``build`` allocates the tensors of :func:`param_specs` in the
region, unset; ``load_weights`` (FREEZE) checks them against the transformers model and fills them
from a seeded generator (``init_std`` large enough for peaked logits) and transformers' rotary
frequencies; ``alloc_state`` allocates the KV cache (zeroed) and the static decode buffers;
``warmup`` runs each batch size's decode step (and compiles); ``capture`` captures the ladder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Any

from .. import _check

ENGINE = "vitrify-transformers"
# SGLang's default decode ladder: 1, 2, 4, 8, 12, 16, then every 8 up to 256 (36 sizes).
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, *range(24, 257, 8))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The model and the serving shape. The defaults are a 1.1 B-parameter Llama (TinyLlama's
    shape: hidden 2048, 22 layers, 32 heads, 4 KV heads, FFN 5632, vocabulary 32000)."""

    arch: str = "llama"  # "llama" or "qwen2" (q/k/v biases)
    vocab: int = 32000
    hidden: int = 2048
    ffn: int = 5632
    layers: int = 22
    heads: int = 32
    kv_heads: int = 4
    max_len: int = 512
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    seed: int = 1234
    init_std: float = 0.2  # peaked logits: greedy tokens have no near-ties
    variant: str = "eager"  # or "compiled"

    def __post_init__(self):
        _check.choice("arch", self.arch, ("llama", "qwen2"))
        _check.choice("variant", self.variant, ("eager", "compiled"))
        for name in ("vocab", "hidden", "ffn", "layers", "heads", "kv_heads", "max_len"):
            _check.integer(name, getattr(self, name), 1, 1 << 24)
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden ({self.hidden}) must divide by heads ({self.heads}) and "
                             f"heads by kv_heads ({self.kv_heads})")
        bss = tuple(_check.integer("batch_sizes[]", b, 1, 1 << 16) for b in self.batch_sizes)
        if not bss or list(bss) != sorted(set(bss)):
            raise ValueError(f"batch_sizes must be non-empty, ascending and unique, got {bss}")
        object.__setattr__(self, "batch_sizes", bss)

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    def model_id(self) -> str:
        return (f"{self.arch}-v{self.vocab}-h{self.hidden}-f{self.ffn}-l{self.layers}-"
                f"a{self.heads}-kv{self.kv_heads}-len{self.max_len}-seed{self.seed}-"
                f"std{self.init_std}-bs{','.join(map(str, self.batch_sizes))}-{self.variant}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["batch_sizes"] = list(self.batch_sizes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> EngineConfig:
        d = dict(d)
        d["batch_sizes"] = tuple(d["batch_sizes"])
        return cls(**d)


def prompts(n: int, seed: int, vocab: int, min_len: int = 8, max_len: int = 48) -> list[list[int]]:
    """``n`` reproducible prompts of random token ids (lengths in ``[min_len, max_len]``)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(n)]


def param_specs(cfg: EngineConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """The engine's tensors in the order they are allocated, as (transformers' parameter name,
    shape, dtype): the decoder's parameters and the rotary frequencies. FREEZE checks them against
    the transformers model; THAW allocates them from this list alone (no transformers import)."""
    hd = cfg.hidden // cfg.heads
    bf = "bfloat16"
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (cfg.vocab, cfg.hidden), bf)]
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        for proj, rows in (("q", cfg.heads * hd), ("k", cfg.kv_heads * hd),
                           ("v", cfg.kv_heads * hd)):
            out.append((f"{p}self_attn.{proj}_proj.weight", (rows, cfg.hidden), bf))
            if cfg.arch == "qwen2":
                out.append((f"{p}self_attn.{proj}_proj.bias", (rows,), bf))
        out += [(f"{p}self_attn.o_proj.weight", (cfg.hidden, cfg.heads * hd), bf),
                (f"{p}mlp.gate_proj.weight", (cfg.ffn, cfg.hidden), bf),
                (f"{p}mlp.up_proj.weight", (cfg.ffn, cfg.hidden), bf),
                (f"{p}mlp.down_proj.weight", (cfg.hidden, cfg.ffn), bf),
                (f"{p}input_layernorm.weight", (cfg.hidden,), bf),
                (f"{p}post_attention_layernorm.weight", (cfg.hidden,), bf)]
    out += [("model.norm.weight", (cfg.hidden,), bf),
            ("lm_head.weight", (cfg.vocab, cfg.hidden), bf),
            ("model.rotary_emb.inv_freq", (hd // 2,), "float32")]
    return out


def fill_weights(weights: dict[str, Any], cfg: EngineConfig) -> None:
    """The engine's seeded initialisation (``cfg.seed``), in :func:`param_specs`' order: norms
    1, biases N(0, 0.02), embeddings N(0, 1), the rest N(0, ``init_std``); the rotary
    frequencies are left alone. The same for the engine and for a trainer that builds the
    weights a cold engine of this config would have."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(cfg.seed)
    with torch.no_grad():
        for name, t in weights.items():
            if name.endswith("inv_freq"):
                continue
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            elif name.endswith(".bias"):
                t.normal_(0.0, 0.02, generator=g)
            else:
                t.normal_(0.0, cfg.init_std if "embed" not in name else 1.0, generator=g)


def update_mapping(cfg: EngineConfig):
    """The Megatron-style layout of this engine's weights onto its own names."""
    from ..weights.mapping import megatron_llama

    return megatron_llama(heads=cfg.heads, kv_heads=cfg.kv_heads,
                          head_dim=cfg.hidden // cfg.heads, qkv_bias=cfg.arch == "qwen2")


def megatron_tensors(weights: dict[str, Any], cfg: EngineConfig) -> dict[str, Any]:
    """The engine's weights in a Megatron-style trainer's layout (what a trainer streams):
    ``linear_qkv`` with each KV group's query heads, key head and value head together,
    ``linear_fc1`` = gate then up, the norms inside the fused linears."""
    from ..weights.mapping import megatron_layout

    return megatron_layout(weights, layers=cfg.layers, heads=cfg.heads, kv_heads=cfg.kv_heads,
                           qkv_bias=cfg.arch == "qwen2")


@dataclasses.dataclass(frozen=True)
class Dims:
    """What the forward needs besides the tensors (plain numbers: torch.compile-friendly)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    bias: bool
    eps: float = 1e-5
    rope_scaling: float = 1.0

    @classmethod
    def of(cls, cfg: EngineConfig, rope_scaling: float = 1.0) -> Dims:
        return cls(cfg.layers, cfg.heads, cfg.kv_heads, cfg.hidden // cfg.heads,
                   cfg.arch == "qwen2", 1e-5, rope_scaling)


def _rms_norm(x, w, eps: float):
    """transformers' RMSNorm: in float32, then the weight times the result in x's dtype."""
    import torch

    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rope(W, positions, d: Dims, dtype):
    """cos and sin of the positions' rotary angles ([..., head_dim/2], ``dtype``), each half once:
    the full-width tables transformers builds are these two halves concatenated."""
    freqs = positions[..., None].float() * W["model.rotary_emb.inv_freq"].float()
    return (freqs.cos() * d.rope_scaling).to(dtype), (freqs.sin() * d.rope_scaling).to(dtype)


def rotary(x, cos, sin):
    """transformers' ``x * cos + rotate_half(x) * sin`` with half-width tables, elementwise only:
    no ``torch.cat``, whose by-value parameter block carries unused slots that may look like
    addresses (a graph holding one cannot be proven relocatable)."""
    import torch

    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    out = torch.empty_like(x)
    out[..., :h] = x1 * cos + (-x2) * sin
    out[..., h:] = x2 * cos + x1 * sin
    return out


def _proj(W, name: str, h, bias: bool):
    import torch.nn.functional as F

    return F.linear(h, W[name + ".weight"], W[name + ".bias"] if bias else None)


def _layer_tail(W, p: str, x, attn, d: Dims):
    """Output projection, residual, post-attention norm, SwiGLU MLP, residual."""
    import torch.nn.functional as F

    x = x + F.linear(attn, W[p + "self_attn.o_proj.weight"])
    h = _rms_norm(x, W[p + "post_attention_layernorm.weight"], d.eps)
    gate = F.silu(F.linear(h, W[p + "mlp.gate_proj.weight"]))
    m = gate * F.linear(h, W[p + "mlp.up_proj.weight"])
    return x + F.linear(m, W[p + "mlp.down_proj.weight"])


def decode_forward(W, d: Dims, k_caches, v_caches, key_index, tokens, positions, rows):
    """One decode step for ``tokens.shape[0]`` rows over the tensors ``W`` (transformers' names),
    against static caches (one ``[max_batch, max_len, kv_heads, head_dim]`` tensor per layer):
    writes each row's new key/value at its position in place, attends over its cache up to it;
    returns ``(logits [bs, vocab], next tokens [bs])``. Device-agnostic; CPU-tested against the
    transformers model's own forward."""
    import torch.nn.functional as F

    bs = tokens.shape[0]
    x = F.embedding(tokens, W["model.embed_tokens.weight"])  # [bs, hidden]
    cos, sin = _rope(W, positions, d, x.dtype)  # [bs, hd/2]
    cos, sin = cos[:, None, None], sin[:, None, None]  # [bs, 1, 1, hd/2]
    mask = (key_index[None, :] <= positions[:, None])[:, None, None, :]
    for i in range(d.layers):
        p = f"model.layers.{i}."
        h = _rms_norm(x, W[p + "input_layernorm.weight"], d.eps)
        q = rotary(_proj(W, p + "self_attn.q_proj", h, d.bias).view(bs, d.heads, 1, d.head_dim),
                   cos, sin)
        k = rotary(_proj(W, p + "self_attn.k_proj", h, d.bias).view(bs, d.kv_heads, 1,
                                                                      d.head_dim), cos, sin)
        v = _proj(W, p + "self_attn.v_proj", h, d.bias).view(bs, d.kv_heads, d.head_dim)
        kc, vc = k_caches[i], v_caches[i]
        kc.index_put_((rows, positions), k.view(bs, d.kv_heads, d.head_dim))
        vc.index_put_((rows, positions), v)
        o = F.scaled_dot_product_attention(q, kc[:bs].transpose(1, 2), vc[:bs].transpose(1, 2),
                                           attn_mask=mask, enable_gqa=True)
        x = _layer_tail(W, p, x, o.reshape(bs, d.heads * d.head_dim), d)
    logits = F.linear(_rms_norm(x, W["model.norm.weight"], d.eps), W["lm_head.weight"])
    return logits, logits.argmax(-1)


def prefill_forward(W, d: Dims, k_caches, v_caches, row: int, ids):
    """Causal forward of one prompt ``ids`` ([n] token ids) writing its keys/values into cache row
    ``row`` (positions ``0..n-1``); returns the last position's logits ``[vocab]``."""
    import torch

    lengths = torch.tensor([ids.shape[0]], device=ids.device)
    return prefill_batch_forward(W, d, k_caches, v_caches, row, ids[None], lengths)[0]


def prefill_batch_forward(W, d: Dims, k_caches, v_caches, row0: int, ids, lengths):
    """Causal forward of ``B`` prompts at once: ``ids`` ``[B, n]`` right-padded (prompt ``b`` is
    ``ids[b, :lengths[b]]``), keys/values written into cache rows ``row0..row0+B-1`` at positions
    ``0..n-1``; returns each prompt's last-token logits ``[B, vocab]``. A real position never
    attends to padding (it comes after, and attention is causal); the padding's keys/values lie
    beyond the prompt, where decode's mask (key position <= the row's position) ignores them
    until decode overwrites them. One batch instead of a forward per prompt: a launch per
    operation for all prompts, and one GEMM shape per layer instead of one per prompt length."""
    import torch
    import torch.nn.functional as F

    B, n = ids.shape
    x = F.embedding(ids, W["model.embed_tokens.weight"])  # [B, n, hidden]
    cos, sin = _rope(W, torch.arange(n, device=ids.device), d, x.dtype)  # [n, hd/2]
    cos, sin = cos[None, :, None], sin[None, :, None]  # [1, n, 1, hd/2]
    for i in range(d.layers):
        p = f"model.layers.{i}."
        h = _rms_norm(x, W[p + "input_layernorm.weight"], d.eps)  # [B, n, hidden]
        q = rotary(_proj(W, p + "self_attn.q_proj", h, d.bias).view(B, n, d.heads, d.head_dim),
                   cos, sin)
        k = rotary(_proj(W, p + "self_attn.k_proj", h, d.bias).view(B, n, d.kv_heads,
                                                                      d.head_dim), cos, sin)
        v = _proj(W, p + "self_attn.v_proj", h, d.bias).view(B, n, d.kv_heads, d.head_dim)
        k_caches[i][row0:row0 + B, :n] = k
        v_caches[i][row0:row0 + B, :n] = v
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True, enable_gqa=True)
        x = _layer_tail(W, p, x, o.transpose(1, 2).reshape(B, n, d.heads * d.head_dim), d)
    last = x[torch.arange(B, device=ids.device), lengths - 1]  # [B, hidden]
    return F.linear(_rms_norm(last, W["model.norm.weight"], d.eps), W["lm_head.weight"])


def _code_digest() -> str:
    """The first 16 hex digits of this module's SHA-256: another forward is another engine."""
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


class CausalLMEngine:
    """The engine and its :class:`vitrify.session.EngineAdapter`. Construct it before CUDA is
    initialised (it imports torch lazily, in ``build``). FREEZE builds the transformers model
    (on the meta device) and checks :func:`param_specs` against it; THAW needs torch only: it
    allocates the same tensors in the same order and the session restores their bytes."""

    def __init__(self, config: EngineConfig | None = None):
        self.cfg = config or EngineConfig()
        if not isinstance(self.cfg, EngineConfig):
            raise _check.ArgumentTypeError(f"config must be an EngineConfig, got "
                                           f"{_check.got(self.cfg)}")
        self.region = None
        self.weights: dict[str, Any] = {}
        self.dims = Dims.of(self.cfg)
        self.torch_graphs: dict[int, Any] = {}  # FREEZE: torch.cuda.CUDAGraph per batch size
        self.loaded = None  # THAW: vitrify LoadedGraphs
        self._step_fn = None
        self.receiver = None  # weight updates (weight_receiver)

    # --- adapter: identity and routing ----------------------------------------------------------
    def fingerprint(self) -> dict:
        """What THAW runs must be what FREEZE ran: vitrify's version and this module's code (the
        forward and the tensor layout) identify the engine. transformers is not in it: THAW does
        not use it (its version at FREEZE is kept in the state)."""
        import vitrify

        return {"engine": ENGINE,
                "engine_version": f"vitrify-{vitrify.__version__}/code-{_code_digest()}",
                "model": self.cfg.model_id()}

    def route(self, region, phase: str):
        from . import torch as vt

        if phase == "capture":
            return vt.activated(region)
        if phase == "load_weights":  # in place: temporaries stay out of the region
            import contextlib

            return contextlib.nullcontext()
        return vt.region_allocations(region)

    # --- adapter: phases ------------------------------------------------------------------------
    def hf_config(self):
        """The transformers config of this engine (FREEZE and tests)."""
        import transformers

        c = self.cfg
        kind = transformers.LlamaConfig if c.arch == "llama" else transformers.Qwen2Config
        conf = kind(vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.ffn,
                    num_hidden_layers=c.layers, num_attention_heads=c.heads,
                    num_key_value_heads=c.kv_heads, max_position_embeddings=c.max_len,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=c.init_std)
        conf._attn_implementation = "sdpa"
        return conf

    def hf_model(self, device: str = "meta"):
        """The transformers model of this engine (bf16), on ``device``."""
        import torch
        import transformers

        kind = (transformers.LlamaForCausalLM if self.cfg.arch == "llama"
                else transformers.Qwen2ForCausalLM)
        with torch.device(device):
            return kind(self.hf_config()).to(torch.bfloat16)

    def check_specs(self, model) -> None:
        """FREEZE: the transformers model must hold exactly :func:`param_specs`' tensors (else
        this transformers version builds another model, and THAW could not rebuild it)."""
        have = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
                for n, t in [*model.named_parameters(), *model.named_buffers()]}
        want = {n: (shape, dtype) for n, shape, dtype in param_specs(self.cfg)}
        params = {n for n, _ in model.named_parameters()}
        missing = [n for n in want if n not in have]
        # The meta model was cast to bf16 as a whole, its rotary buffer too; the engine keeps
        # that buffer in float32 (transformers computes it in float32): compare its shape only.
        wrong = [f"{n}: {have[n]} != {want[n]}" for n in want if n in have and have[n] != want[n]
                 and not (n.endswith("inv_freq") and have[n][0] == want[n][0])]
        extra = sorted(params - set(want))
        if missing or wrong or extra:
            raise RuntimeError(f"transformers builds another {self.cfg.arch} model than this "
                               f"engine expects: missing {missing[:3]}, different {wrong[:3]}, "
                               f"extra parameters {extra[:3]}")

    def build(self, region) -> None:
        import torch

        self.region = region
        # Allocated in param_specs' order, unset: FREEZE fills them, THAW restores their bytes.
        self.weights = {name: torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
                        for name, shape, dtype in param_specs(self.cfg)}

    def load_weights(self) -> None:
        import torch

        meta = self.hf_model("meta")
        self.check_specs(meta)
        fill_weights(self.weights, self.cfg)
        with torch.no_grad():
            # The rotary frequencies as transformers computes them (its module, on the CPU).
            rot = type(meta.model.rotary_emb)(config=meta.config)
            self.weights["model.rotary_emb.inv_freq"].copy_(rot.inv_freq)
            self.dims = Dims.of(self.cfg, float(rot.attention_scaling))
        torch.cuda.synchronize()

    # --- weight update (vitrify.weights) ----------------------------------------------------------
    def weight_receiver(self):
        """A :class:`vitrify.weights.transport.Receiver` that updates this engine's weights in
        place (their region addresses, hence every graph, unchanged) from a trainer holding them
        in the Megatron layout (:func:`megatron_tensors`). :meth:`serve` refuses while an update
        is running or after one failed. An engine thawed with ``exportable=True`` also takes
        direct updates (the trainer writes its weights in place, no staging)."""
        import torch

        from ..weights.transport import Receiver, region_exporter

        if self.receiver is None:  # one per engine: its state and digests outlive each update
            exporter = None
            if getattr(self.region, "exportable", False):  # thawed with exportable=True
                exporter = region_exporter(self.region)
            self.receiver = Receiver(self.weights, update_mapping(self.cfg),
                                     synchronize=torch.cuda.synchronize, exporter=exporter)
        return self.receiver

    def alloc_state(self) -> None:
        import torch

        c = self.cfg
        shape = (c.max_batch, c.max_len, c.kv_heads, c.hidden // c.heads)
        self.k_caches = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
                         for _ in range(c.layers)]
        self.v_caches = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
                         for _ in range(c.layers)]
        self.tokens = torch.zeros(c.max_batch, dtype=torch.long, device="cuda")
        self.positions = torch.zeros(c.max_batch, dtype=torch.long, device="cuda")
        self.rows = torch.arange(c.max_batch, dtype=torch.long, device="cuda")
        self.key_index = torch.arange(c.max_len, dtype=torch.long, device="cuda")
        self.logits = torch.zeros(c.max_batch, c.vocab, dtype=torch.bfloat16, device="cuda")
        self.next_tokens = torch.zeros(c.max_batch, dtype=torch.long, device="cuda")
        torch.cuda.synchronize()

    def _step(self, bs: int) -> None:
        import torch

        with torch.no_grad():
            logits, nxt = self._step_fn(self.weights, self.dims, self.k_caches, self.v_caches,
                                        self.key_index, self.tokens[:bs], self.positions[:bs],
                                        self.rows[:bs])
            self.logits[:bs].copy_(logits)
            self.next_tokens[:bs].copy_(nxt)

    def _make_step(self) -> None:
        import torch

        if self.cfg.variant == "compiled":
            # The caches are updated in place by the compiled step, never copied. Marked here,
            # not in alloc_state: a THAW that restores warmup never imports Dynamo (~4 s).
            for t in self.k_caches + self.v_caches:
                torch._dynamo.mark_static_address(t)
            self._step_fn = torch.compile(decode_forward, dynamic=True)
        else:
            self._step_fn = decode_forward

    def compile(self) -> None:
        """The compiled variant's JIT work (Dynamo, Inductor, Triton autotuning), outside the
        region (session P11): one step per batch size, so warmup finds every kernel compiled."""
        import torch

        self._make_step()
        if self.cfg.variant != "compiled":
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bs in self.cfg.batch_sizes:
                self._step(bs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def warmup(self) -> None:
        import torch

        if self._step_fn is None:
            self._make_step()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bs in self.cfg.batch_sizes:
                for _ in range(2):
                    self._step(bs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def capture(self, graphs) -> None:
        import torch

        from . import torch as vt

        if graphs is None:
            raise ValueError("the transformers engine captures decode graphs: freeze it with "
                             "record_kernels=True")
        if self._step_fn is None:
            self._make_step()
        for bs in self.cfg.batch_sizes:
            with graphs.capture(f"decode_bs{bs}", pool=vt.pool_id(self.region)) as cap:
                self._step(bs)
            self.torch_graphs[bs] = cap.graph
        torch.cuda.synchronize()

    def state(self) -> dict:
        import transformers

        return {"config": self.cfg.to_dict(), "rope_scaling": self.dims.rope_scaling,
                "frozen_with": {"transformers": transformers.__version__}}

    def restore_state(self, state: dict, graphs) -> None:
        if EngineConfig.from_dict(state["config"]) != self.cfg:
            raise ValueError("the archive's engine config differs from this engine's")
        self.dims = Dims.of(self.cfg, float(state["rope_scaling"]))
        self.loaded = graphs

    # --- serving --------------------------------------------------------------------------------
    def _prefill(self, batch: list[list[int]]) -> list[int]:
        """Eager prefill of the prompts, one right-padded batch, into cache rows ``0..len-1``;
        returns each prompt's first generated token."""
        import torch

        for ids in batch:
            if not 0 < len(ids) < self.cfg.max_len:
                raise ValueError(f"a prompt must have 1..{self.cfg.max_len - 1} tokens, got "
                                 f"{len(ids)}")
        n = max(len(ids) for ids in batch)
        with torch.no_grad():
            t = torch.tensor([ids + [0] * (n - len(ids)) for ids in batch], dtype=torch.long,
                             device="cuda")
            lengths = torch.tensor([len(ids) for ids in batch], device="cuda")
            logits = prefill_batch_forward(self.weights, self.dims, self.k_caches, self.v_caches,
                                           0, t, lengths)
            return logits.argmax(-1).tolist()

    def _replay(self, bs: int) -> None:
        import torch

        if self.loaded is not None:
            self.loaded.replay(f"decode_bs{bs}", stream=torch.cuda.current_stream())
        else:
            self.torch_graphs[bs].replay()

    def serve(self, batch: list[list[int]], steps: int) -> dict:
        """Greedy generation for ``batch`` prompts: prefill them eagerly in one right-padded
        batch, then ``steps`` decode steps through the decode graph of the smallest captured
        batch size that fits. Returns the tokens per prompt, the SHA-256 of each step's logits
        bytes (rows of the batch) and ``first_token_s`` (until every prompt's first token exists)."""
        import torch

        if self.receiver is not None and self.receiver.state != "ready":
            raise RuntimeError(f"the engine's weights are {self.receiver.state}: a weight update "
                               f"is running or failed; complete it before serving")
        c = self.cfg
        n = len(batch)
        bs = next((b for b in c.batch_sizes if b >= n), None)
        if bs is None:
            raise ValueError(f"{n} prompts exceed the largest captured batch size {c.max_batch}")
        if max(len(p) for p in batch) + steps >= c.max_len:
            raise ValueError(f"prompt + {steps} steps exceed max_len {c.max_len}")
        t0 = time.perf_counter()
        first = self._prefill(batch)
        first_token_s = time.perf_counter() - t0  # .tolist() synchronised: the tokens exist
        toks = [[t] for t in first]
        with torch.no_grad():
            self.tokens[:bs].zero_()
            self.positions[:bs].zero_()
            self.tokens[:n].copy_(torch.tensor(first, device="cuda"))
            self.positions[:n].copy_(torch.tensor([len(p) for p in batch], device="cuda"))
            hashes = []
            for _ in range(steps):
                self._replay(bs)
                torch.cuda.current_stream().synchronize()
                hashes.append(hashlib.sha256(
                    self.logits[:n].view(torch.int16).cpu().numpy().tobytes()).hexdigest())
                nxt = self.next_tokens[:n].tolist()
                for r in range(n):
                    toks[r].append(int(nxt[r]))
                self.tokens[:bs].copy_(self.next_tokens[:bs])
                self.positions[:bs].add_(1)
        return {"batch_size": bs, "tokens": toks, "logits_sha256": hashes,
                "first_token_s": first_token_s}


# ------------------------------------------------------------------------- process entry point
_T0 = time.time()  # this module's import: the clock when OPTS carries no "t0"


def main(argv: list[str] | None = None) -> int:
    """``python -m vitrify.integrations.transformers MODE ARCHIVE CONFIG_JSON [OPTS_JSON]``:
    MODE ``freeze`` (FREEZE into ARCHIVE), ``thaw`` (THAW from it) or ``cold`` (the same phases,
    no archive: the cold start to compare with); then serve OPTS.prompts (16) new prompts
    (OPTS.prompt_seed, never seen at FREEZE) for OPTS.steps (32) decode steps. THAW options:
    ``occupy`` (reserve the frozen range first, so the session must relocate),
    ``warmup_restore`` and ``rebuild_again`` (after serving, rebuild the graph ladder once more
    alone and report its time as ``rebuild_alone``). Prints one JSON line last (tokens, logits
    hashes, session timings, ``ready_s`` / ``first_token_s`` / ``process_s`` counted from
    OPTS.t0, the parent's ``time.time()`` at launch, else this module's import)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (3, 4) or args[0] not in ("freeze", "thaw", "cold", "trainer"):
        print("usage: python -m vitrify.integrations.transformers freeze|thaw|cold ARCHIVE "
              "CONFIG_JSON [OPTS_JSON]\n"
              "       python -m vitrify.integrations.transformers trainer SOCKET CONFIG_JSON "
              "[OPTS_JSON]", file=sys.stderr)
        return 2
    mode, path = args[0], args[1]
    cfg_d = json.loads(args[2])
    opts = json.loads(args[3]) if len(args) > 3 else {}
    t0 = float(opts.get("t0", _T0))
    if mode == "trainer":
        from .._worker import report

        return report(lambda: _train_and_send(path, EngineConfig.from_dict(cfg_d), opts))

    def run() -> dict:
        from .. import session

        cfg = EngineConfig.from_dict(cfg_d)
        eng = CausalLMEngine(cfg)
        out: dict = {"mode": mode}
        region_bytes = opts.get("region_bytes", 12 << 30)
        if mode == "freeze":
            out["session"] = session.FreezeSession(eng, path, region_bytes=region_bytes,
                                                   overwrite=True).run()
        elif mode == "cold":  # the same phases, no archive, no kernel recording: a cold start
            out["session"] = _cold(eng, region_bytes)
        else:
            blocker = None
            if opts.get("occupy"):
                from .. import Region, archive

                frozen = archive.open_archive(path).region
                blocker = Region(frozen.size, base=frozen.base)
            s = session.ThawSession(eng, path, warmup_restore=opts.get("warmup_restore"),
                                    exportable=bool(opts.get("exportable")))
            out["session"] = s.run()
            out["blocked"] = blocker is not None
            if opts.get("update_socket"):
                out["update"] = _receive_update(eng, opts["update_socket"])
        out["ready_s"] = time.time() - t0
        import torch

        batch = prompts(opts.get("prompts", 16), opts.get("prompt_seed", 99), cfg.vocab)
        t = time.perf_counter()
        served = eng.serve(batch, opts.get("steps", 32))
        torch.cuda.synchronize()
        out["serve_s"] = time.perf_counter() - t
        out["first_token_s"] = out["ready_s"] + served.pop("first_token_s", 0.0)
        out.update(served)
        out["process_s"] = time.time() - t0
        if mode == "thaw" and opts.get("rebuild_again"):
            # rebuild_again: True (4 build threads, THAW's default) or a list of thread counts
            # (a sweep; the first count's figures are the result, every count's under "sweep")
            again = opts["rebuild_again"]
            counts = [4] if again is True else [int(n) for n in again]
            sweep = [_rebuild_alone(path, out["session"]["base"], n) for n in counts]
            out["rebuild_alone"] = dict(sweep[0], sweep=sweep) if len(sweep) > 1 else sweep[0]
        return out

    from .._worker import report

    return report(run)


def _receive_update(eng: CausalLMEngine, path: str) -> dict:
    """THAW's ``update_socket`` option: take one weight update from a trainer at ``path`` into
    the thawed engine, in place; report it with the evidence that nothing moved (the weights'
    addresses and the graphs the same objects) and a device-to-device copy of the same bytes
    measured right after (the update's baseline)."""
    import torch

    from ..weights.transport import listen

    before = {n: t.data_ptr() for n, t in eng.weights.items()}
    graphs_before = (id(eng.loaded), len(eng.loaded) if eng.loaded is not None else 0)
    rx = eng.weight_receiver()
    try:
        with listen(path) as srv:
            conn, _ = srv.accept()
            with conn:
                summary = rx.serve_one(conn)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    moved = [t for n, t in eng.weights.items() if not n.endswith("inv_freq")]
    scratch = torch.empty(sum(t.numel() * t.element_size() for t in moved), dtype=torch.uint8,
                          device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    at = 0
    for w in moved:
        n = w.numel() * w.element_size()
        scratch[at:at + n].copy_(w.view(-1).view(torch.uint8))
        at += n
    torch.cuda.synchronize()
    d2d = time.perf_counter() - t
    del scratch
    return {**summary, "state": rx.state,
            "weights_in_place": before == {n: t.data_ptr() for n, t in eng.weights.items()},
            "graphs_unchanged": graphs_before == (id(eng.loaded), len(eng.loaded)
                                                  if eng.loaded is not None else 0),
            "graphs": graphs_before[1], "d2d_copy_seconds": d2d,
            # bytes/s of the update over bytes/s of one device-to-device copy of the same bytes
            "update_throughput_over_d2d": (d2d / summary["seconds"] if summary["seconds"] > 0
                                           else None)}


def _train_and_send(path: str, cfg: EngineConfig, opts: dict) -> dict:
    """``trainer`` mode: the weights a cold engine of ``cfg`` would have (its seed), in the
    Megatron layout, streamed to the engine listening at ``path`` through a staging buffer of
    OPTS.chunk_bytes (default 256 MiB) on the GPU, or with OPTS.direct written straight into
    the engine's exported weights (its THAW took OPTS.exportable)."""
    import torch

    from ..weights.transport import Sender

    weights = {n: torch.empty(shape, dtype=getattr(torch, dt), device="cuda")
               for n, shape, dt in param_specs(cfg)}
    fill_weights(weights, cfg)
    src = megatron_tensors(weights, cfg)
    chunk_bytes = int(opts.get("chunk_bytes", 256 << 20))
    direct = bool(opts.get("direct"))
    tx = Sender(None if direct else chunk_bytes, device=0, direct=direct)
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        # the engine listens once it has thawed
        fin = tx.update(path, src, connect_timeout=float(opts.get("wait_s", 300)),
                        synchronize=torch.cuda.synchronize)
        return {"finished": fin, "chunk_bytes": 0 if direct else chunk_bytes, "direct": direct,
                "staging_bytes": 0 if tx.staging is None else tx.staging.nbytes,
                "torch_bytes_during_update": torch.cuda.max_memory_allocated() - base}
    finally:
        tx.close()


def _rebuild_alone(path: str, base: int, threads: int = 4) -> dict:
    """The graph ladder rebuilt once more after serving, with nothing else running: the archive's
    files verified and read, every module loaded, every graph built (a benchmark's measurement of
    the rebuild itself; THAW's own runs beside the main thread's phases)."""
    from .. import archive as _archive
    from .. import graph as _graph

    t = time.perf_counter()
    opened = _archive.open_archive(path)
    t_open = time.perf_counter()
    loaded = _graph.load_from_archive(opened, 0, region_base=base, threads=threads)
    t_started = time.perf_counter()  # files read and verified, graphs parsed and added
    loaded.wait_all()
    t_end = time.perf_counter()
    stats = loaded.stats()
    loaded.close()
    return {"seconds": t_end - t, "threads": threads, "stats": stats,
            "open_s": t_open - t, "read_and_add_s": t_started - t_open,
            "build_wait_s": t_end - t_started}


def run_process(mode: str, archive: str, cfg: dict, opts: dict | None = None,
                timeout: int = 900, env: dict[str, str] | None = None) -> dict:
    """Run :func:`main` in a fresh process (``python -m vitrify.integrations.transformers``) with
    this process's clock as its start (``env``: variables added to this process's environment);
    return its result, or raise naming the mode and error."""
    import os
    import subprocess

    opts = dict(opts or {}, t0=time.time())
    p = subprocess.run([sys.executable, "-m", __name__, mode, archive, json.dumps(cfg),
                        json.dumps(opts)], capture_output=True, text=True, timeout=timeout,
                       env=None if env is None else {**os.environ, **env})
    return result_of(mode, p.stdout, p.stderr, p.returncode)


def result_of(what: str, stdout: str, stderr: str, returncode: int | None = None) -> dict:
    """The result line :func:`main` printed (its last JSON line), or RuntimeError naming
    ``what`` with the error and the tail of stderr."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"{what} printed no result (exit {returncode}): {stderr[-2000:]}")
    r = json.loads(lines[-1])
    if not r.get("ok"):
        raise RuntimeError(f"{what} failed: {r.get('error')}\n{r.get('traceback', '')}"
                           f"{stderr[-2000:]}")
    return r


def _cold(a: CausalLMEngine, region_bytes: int) -> dict:
    """FREEZE's phases without kernel recording or an archive: the cold start to compare with."""
    from ..region import Region
    from ..session import Timings, run_phases

    t = Timings()
    with t.step("reserve"):
        region = Region(region_bytes)
    run_phases(a, region, _TorchGraphs(), t)
    return {"timings": t.as_dict(), "base": region.base}


class _TorchGraphs:
    """``capture(name, pool=...)`` as torch alone does it (what a server without vitrify runs)."""

    class _Capture:
        def __init__(self, pool):
            import torch

            self.graph = torch.cuda.CUDAGraph()
            self._ctx = torch.cuda.graph(self.graph, pool=pool)

        def __enter__(self):
            self._ctx.__enter__()
            return self

        def __exit__(self, *exc):
            return self._ctx.__exit__(*exc)

    def capture(self, name: str, pool=None):
        return self._Capture(pool)


__all__ = ["CausalLMEngine", "DEFAULT_BATCH_SIZES", "Dims", "ENGINE", "EngineConfig",
           "decode_forward", "main", "param_specs", "prefill_batch_forward",
           "prefill_forward", "prompts", "rotary",
           "run_process"]

if __name__ == "__main__":
    sys.exit(main())
