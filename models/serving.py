"""The serving engine: weight-only quantization, sampling, continuous batching and speculative decoding, over the
key-value cache and cached forward pass of models/inference.py.

    eng = Engine(model, slots=8, max_len=256, quant="int8", kv_dtype="int8", seed=0)
    done = eng.serve([Request(0, prompt_tokens, max_new=64), ...])   # continuous batching over fixed slots
    out, stats = speculative_generate(target_model, draft_model, prompts_bt, n_new=64, k=4)

Weights: 'none' keeps the policy's compute dtype; 'int8', 'int4' and 'fp8' (E4M3) store each matmul weight of the
layers and the untied output head as a qwix.QArray (Qwix, Google's JAX quantization library): symmetric absmax scales
in float32, one per output channel (and per layer and expert of a stacked weight), and with a group size
('int4:g128') one per group of that many consecutive input elements as well. The step dequantizes the weight
(qwix.dequantize) inside the compiled program, where XLA fuses the conversion into the consumer on TPU and GPU (on
XLA:CPU the dequantized weight is a temporary). Embeddings, norms, biases and the MoE router stay unquantized.

Continuous batching: `slots` rows share one cache; a request is inserted into a free slot (its prompt prefilled into
that row alone, right-padded to a power-of-two bucket so that a handful of prefill programs serve every length), every
step decodes one token in all occupied slots, and a request leaves its slot when it has its tokens. The schedule is
deterministic for a given request list and seed (sampling keys are folded from the seed and the step).

Speculative decoding (greedy): a draft model proposes k tokens one at a time; the target scores all k + 1 positions in
one forward pass and keeps the longest prefix it agrees with plus its own next token, so the output is exactly the
target's greedy output (tests/models/test_serving.py) and each round emits 1 to k + 1 tokens.
"""
from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models import inference, paged
from models.config import resolve_attention
from workbench.errors import WorkbenchError

QUANTS = ("none", "int8", "int4", "fp8")
_QTYPE = {"int8": jnp.int8, "int4": jnp.int4, "fp8": jnp.float8_e4m3fn}
_MATRIX_AXES = ("layers", "experts")  # stacked weights: one scale set per layer and per expert


# ------------------------------------------------------------------------------------------------ quantization


def parse_quant(quant: str) -> tuple[str, int]:
    """'int8' -> ('int8', 0): one scale per output channel; 'int4:g128' -> ('int4', 128): one scale per output
    channel and per group of 128 consecutive input elements."""
    name, sep, group = str(quant).partition(":g")
    if name not in QUANTS:
        raise WorkbenchError(f"unknown weight quantization {quant!r}; choose one of {', '.join(QUANTS)}, optionally "
                             f"with a group size (int4:g128)")
    if not sep:
        return name, 0
    if name == "none" or not group.isdigit() or int(group) < 1:
        raise WorkbenchError(f"bad weight quantization {quant!r}: a group size is a positive integer after ':g' on "
                             f"int8, int4 or fp8 (int4:g128)")
    return name, int(group)


def check_quant(quant: str) -> str:
    parse_quant(quant)
    return quant


def _matmul_axes(path, axes, shape) -> tuple[list[int], list[int], list[int]] | None:
    """(per-matrix axes, input axes, output axes) of a matmul weight from its logical axis names, or None where the
    parameter is no matmul weight to quantize (embeddings, norms, biases, the router)."""
    name = path[-1]
    if not (isinstance(name, str) and name.startswith("w_") and "router" not in name) or axes is None:
        return None
    if not (path[0] == "blocks" or path == ("w_dv",)) or len(axes) != len(shape):
        return None
    stack = [i for i, a in enumerate(axes) if a in _MATRIX_AXES]
    rest = [i for i in range(len(axes)) if i not in stack]
    names = [axes[i] for i in rest]
    if len(rest) < 2 or "embed" not in names:
        return None
    # the input side: 'embed' where it leads (projections up: w_dnh, w_df, w_dv), else every axis before it
    # (projections down to the residual: w_nhd over heads and head_dim, w_fd over mlp)
    cut = 1 if names[0] == "embed" else names.index("embed")
    return stack, rest[:cut], rest[cut:]


def _scale_layout(path, shape, stack, ins, outs, group: int) -> tuple[tuple[int, ...], dict[int, int]]:
    """Qwix's channelwise and tiled axes: a scale per matrix and output channel, and with a group size per group of
    `group` consecutive elements of the flattened input axes."""
    channelwise, tiled, left = list(stack) + list(outs), {}, group
    if group:
        for i in reversed(ins):
            if left == 1:
                channelwise.append(i)
            elif left >= shape[i] and left % shape[i] == 0:
                left //= shape[i]  # the whole axis inside each group
            elif shape[i] % left == 0:
                tiled[i], left = left, 1
            else:
                break
        if left != 1:
            width = int(np.prod([shape[i] for i in ins]))
            raise WorkbenchError(f"group size {group} does not tile the input axes {[shape[i] for i in ins]} "
                                 f"(width {width}) of {'/'.join(map(str, path))}; choose a divisor of {width}")
    return tuple(sorted(channelwise)), tiled


def _quantize(path, var, quant: str):
    """The weight as a qwix.QArray (symmetric absmax scales in float32), or unchanged where it is no matmul weight."""
    import qwix

    w = var.get_value()
    found = _matmul_axes(path, var.get_metadata().get("out_sharding"), getattr(w, "shape", ()))
    if found is None:
        return w
    name, group = parse_quant(quant)
    channelwise, tiled = _scale_layout(path, w.shape, *found, group)
    return qwix.quantize(w.astype(jnp.float32), _QTYPE[name], channelwise_axes=channelwise, tiled_axes=tiled,
                         scale_dtype=jnp.float32)


def _map_params(state, fn):
    from flax import nnx

    pairs = [(path, var.replace(fn(path, var))) for path, var in nnx.to_flat_state(state)]
    return nnx.from_flat_state(pairs)


def cast_params(params, dtype):
    """Floating parameters in `dtype` (inference keeps no float32 master copy)."""
    return _map_params(params, lambda p, var: var.get_value().astype(dtype)
                       if jnp.issubdtype(var.get_value().dtype, jnp.floating) else var.get_value())


def quantize_params(params, quant: str):
    """An nnx.State of parameters with each matmul weight stored as a qwix.QArray (quant 'none': unchanged)."""
    if parse_quant(quant)[0] == "none":
        return params
    return _map_params(params, lambda p, var: _quantize(p, var, quant))


def is_quantized(value) -> bool:
    import qwix

    return isinstance(value, qwix.QArray)


def dequantize_params(params, dtype):
    """The parameters the model computes with: every quantized weight back in `dtype` (inside the compiled step)."""
    import qwix

    return _map_params(params, lambda p, var: qwix.dequantize(var.get_value()).astype(dtype)
                       if is_quantized(var.get_value()) else var.get_value())


def weight_bytes(params) -> int:
    """Bytes the parameters occupy as stored (int4 at half a byte per element)."""
    return inference.tree_bytes(params)


# ------------------------------------------------------------------------------------------------ sampling


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0            # 0: all tokens
    top_p: float = 1.0        # nucleus: the smallest set of tokens whose probability reaches top_p

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise WorkbenchError(f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got {self}")


def sample(logits_bv, key, s: Sampling):
    """Next tokens (b,) int32 from logits (b, v)."""
    if s.temperature == 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    lg = logits_bv.astype(jnp.float32) / s.temperature
    neg = jnp.finfo(jnp.float32).min
    if s.top_k:
        kth = jax.lax.top_k(lg, s.top_k)[0][:, -1:]
        lg = jnp.where(lg < kth, neg, lg)
    if s.top_p < 1.0:
        srt = jnp.sort(lg, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(srt, axis=-1), axis=-1)
        # keep a sorted token while the probability before it is under top_p (the first always stays)
        keep = (cum - jax.nn.softmax(srt, axis=-1)) < s.top_p
        cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        lg = jnp.where(lg < cutoff, neg, lg)
    return jax.random.categorical(key, lg, axis=-1).astype(jnp.int32)


# ------------------------------------------------------------------------------------------------ the model's steps


class Steps:
    """The compiled steps of one model for serving: its layers unrolled, its weights cast to the compute dtype and
    quantized, the cache donated to every step that writes it."""

    def __init__(self, model, *, quant: str = "none", kv_dtype: str = "auto", platform: str | None = None):
        from flax import nnx

        # attention 'auto' made concrete for the platform it runs on (a prefill attends over its prompt alone)
        cfg = resolve_attention(model.cfg, platform or jax.devices()[0].platform, inference.compute_dtype_of(model))
        model = inference.unrolled(model, attention=cfg.attention)
        self.cfg, self.kv_dtype, self.quant = model.cfg, inference.kv_dtype_name(kv_dtype), check_quant(quant)
        self.compute_dtype = inference.compute_dtype_of(model)
        self._template = model
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.params = quantize_params(cast_params(params, self.compute_dtype), quant)
        self.jitted: dict = {}  # compiled helpers kept with the weights they serve (greedy_generate, speculation)

    def model(self, params, rest):
        from flax import nnx

        return nnx.merge(self.graphdef, dequantize_params(params, self.compute_dtype), rest)

    def init_cache(self, batch: int, max_len: int) -> dict:
        return inference.init_cache(self._template, batch, max_len, self.kv_dtype)

    # pure functions of (params, rest, ...), jitted by the callers with the cache donated
    def prefill(self, params, rest, tokens_bt, lengths_b, cache):
        """Prompts (right-padded) into a cache whose rows are empty: (last logits (b, v), cache)."""
        cache = dict(cache, lengths=jnp.zeros_like(cache["lengths"]))
        logits, cache = inference.prefill(self.model(params, rest), tokens_bt, cache=cache, lengths_b=lengths_b,
                                          last_only=True, fresh=True)
        return logits[:, 0], cache

    def decode(self, params, rest, tokens_b, cache, active_b=None):
        logits, cache = inference.decode_step(self.model(params, rest), tokens_b[:, None], cache, active_b)
        return logits[:, 0], cache

    def init_paged(self, batch: int, max_len: int, page_size: int) -> dict:
        return paged.init_paged(self._template, batch, max_len, page_size)

    def decode_paged(self, params, rest, tokens_b, cache):
        """decode over a paged cache (models/paged.py, the page-table gather form)."""
        logits, cache = paged.paged_forward(self.model(params, rest), tokens_b[:, None], cache)
        cache["lengths"] = cache["lengths"] + 1
        return logits[:, 0], cache

    def verify(self, params, rest, tokens_bt, cache):
        """Logits of every position of t new tokens (b, t, v), the cache's lengths left where they were."""
        return inference.forward(self.model(params, rest), tokens_bt, cache)


def _rows(cache, slot, n=1):
    """The cache's rows [slot, slot + n) as a cache of their own."""
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, n, axis=0), cache)


def _put_rows(cache, rows, slot):
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, slot, axis=0), cache, rows)


def bucket(n: int, max_len: int, smallest: int = 16) -> int:
    """The padded prompt length a prompt of n tokens is prefilled at: the next power of two (at least `smallest`),
    capped at max_len."""
    b = smallest
    while b < n:
        b *= 2
    return min(b, max_len)


# ------------------------------------------------------------------------------------------------ continuous batching


@dataclasses.dataclass(frozen=True)
class Request:
    id: int
    prompt: np.ndarray  # int32 tokens
    max_new: int


@dataclasses.dataclass
class Served:
    id: int
    prompt_len: int
    tokens: list[int]
    admitted_step: int   # the decode step before which its prompt was prefilled
    finished_step: int   # the decode step after which it had all its tokens (admitted_step when max_new == 1)


class Engine:
    """Continuous batching over `slots` rows of one cache of max_len positions (see the module's docstring)."""

    def __init__(self, model, slots: int, max_len: int, *, quant: str = "none", kv_dtype: str = "auto",
                 sampling: Sampling = Sampling(), seed: int = 0, steps: Steps | None = None):
        if slots < 1:
            raise WorkbenchError(f"the engine needs at least one slot, got {slots}")
        self.steps = steps or Steps(model, quant=quant, kv_dtype=kv_dtype)
        self.slots, self.max_len, self.sampling, self.seed = slots, max_len, sampling, seed
        self.cache = self.steps.init_cache(slots, max_len)
        st = self.steps

        def insert(params, rest, cache, slot, tokens_1t, length, key):
            logits, row = st.prefill(params, rest, tokens_1t, length[None], _rows(cache, slot))
            return sample(logits, key, sampling)[0], _put_rows(cache, row, slot)

        def decode(params, rest, cache, tokens_b, active_b, key):
            logits, cache = st.decode(params, rest, tokens_b, cache, active_b)
            return sample(logits, key, sampling), cache

        self._insert = jax.jit(insert, donate_argnums=2)
        self._decode = jax.jit(decode, donate_argnums=2)

    @classmethod
    def from_steps(cls, steps: Steps, slots: int, max_len: int, *, sampling: Sampling = Sampling(), seed: int = 0):
        return cls(None, slots, max_len, sampling=sampling, seed=seed, steps=steps)

    def _key(self, step: int, salt: int):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), step), salt)

    def serve(self, requests: list[Request], on_step=None) -> list[Served]:
        """Run every request to completion; returns them in the order they finished."""
        for r in requests:
            if len(r.prompt) + r.max_new > self.max_len or len(r.prompt) < 1 or r.max_new < 1:
                raise WorkbenchError(f"request {r.id}: a prompt of {len(r.prompt)} tokens and {r.max_new} new ones "
                                     f"do not fit a cache of {self.max_len} positions (or are empty)")
        queue, live, done, step = collections.deque(requests), [None] * self.slots, [], 0
        st = self.steps
        while queue or any(live):
            for i in range(self.slots):
                if live[i] is None and queue:
                    r = queue.popleft()
                    n = len(r.prompt)
                    padded = np.zeros((1, bucket(n, self.max_len)), np.int32)
                    padded[0, :n] = r.prompt
                    tok, self.cache = self._insert(st.params, st.rest, self.cache, i, padded, jnp.int32(n),
                                                   self._key(step, 1_000_000 + r.id))
                    live[i] = Served(r.id, n, [int(tok)], step, step)
                    if r.max_new == 1:
                        done.append(live[i])
                        live[i] = None
            if not any(live):
                continue
            active = np.array([s is not None for s in live])
            last = np.array([s.tokens[-1] if s else 0 for s in live], np.int32)
            nxt, self.cache = self._decode(st.params, st.rest, self.cache, last, active, self._key(step, 0))
            nxt = np.asarray(nxt)
            step += 1
            for i, s in enumerate(live):
                if s is None:
                    continue
                s.tokens.append(int(nxt[i]))
                want = next(r.max_new for r in requests if r.id == s.id)
                if len(s.tokens) >= want:
                    s.finished_step = step
                    done.append(s)
                    live[i] = None
            if on_step:
                on_step(step, len(done), sum(s is not None for s in live))
        return done


# ------------------------------------------------------------------------------------------------ speculative decoding


def greedy_generate(steps: Steps, prompts_bt, n_new: int, max_len: int):
    """Plain greedy decoding of n_new tokens per row with the serving steps: (b, t + n_new) tokens."""
    if "greedy" not in steps.jitted:
        def first(params, rest, tokens_bt, lengths_b, cache):
            logits, cache = steps.prefill(params, rest, tokens_bt, lengths_b, cache)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

        def nxt(params, rest, tok_b, cache):
            logits, cache = steps.decode(params, rest, tok_b, cache)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

        steps.jitted["greedy"] = (jax.jit(first, donate_argnums=4), jax.jit(nxt, donate_argnums=3))
    first, nxt = steps.jitted["greedy"]
    b, t = prompts_bt.shape
    tok, cache = first(steps.params, steps.rest, prompts_bt, jnp.full((b,), t, jnp.int32),
                       steps.init_cache(b, max_len))
    out = [tok]
    for _ in range(n_new - 1):
        tok, cache = nxt(steps.params, steps.rest, tok, cache)
        out.append(tok)
    return np.concatenate([np.asarray(prompts_bt), np.stack([np.asarray(o) for o in out], axis=1)], axis=1)


def speculative_generate(target: Steps, draft: Steps, prompts_bt, n_new: int, k: int, max_len: int,
                         temperature: float = 0.0, seed: int = 0):
    """Speculative decoding of n_new tokens per row. temperature 0: greedy (the output is the target's greedy
    output); above 0: exact rejection sampling (Leviathan et al. 2023: a proposal x is kept with probability
    min(1, p(x)/q(x)), a rejection resamples from max(0, p − q) normalised, so every token is distributed as the
    target's own sampling at that temperature). Returns (tokens (b, t + n_new), stats): rounds, drafted and accepted
    tokens, acceptance rate (accepted / drafted), tokens per round."""
    if k < 1:
        raise WorkbenchError(f"--draft-tokens must be >= 1, got {k}")
    b, t = prompts_bt.shape
    if t + n_new + k + 1 > max_len:
        raise WorkbenchError(f"prompt {t} + {n_new} new + {k + 1} speculative positions exceed the cache ({max_len})")
    key = ("speculative", id(draft), k, float(temperature))
    if key not in target.jitted:
        target.jitted[key] = speculative_steps(target, draft, k, temperature)
    fns = target.jitted[key]
    tc, dc = target.init_cache(b, max_len), draft.init_cache(b, max_len)
    lengths = jnp.full((b,), t, jnp.int32)
    rng = jax.random.key(seed)
    cur, tc = fns["prefill_target"](target.params, target.rest, prompts_bt, lengths, tc, jax.random.fold_in(rng, 0))
    _, dc = fns["prefill_draft"](draft.params, draft.rest, prompts_bt, lengths, dc, jax.random.fold_in(rng, 0))
    out = [list(map(int, row)) + [int(c)] for row, c in zip(np.asarray(prompts_bt), np.asarray(cur))]
    rounds = drafted = accepted = 0
    while min(len(o) for o in out) < t + n_new:
        emitted, n_acc, tc, dc = fns["round"](target.params, target.rest, draft.params, draft.rest, cur, tc, dc,
                                              jax.random.fold_in(rng, rounds + 1))
        emitted, n_acc = np.asarray(emitted), np.asarray(n_acc)
        for i in range(b):
            out[i].extend(int(x) for x in emitted[i, :n_acc[i] + 1])
        cur = jnp.asarray([o[-1] for o in out], jnp.int32)
        rounds += 1
        drafted += b * k
        accepted += int(n_acc.sum())
    tokens = np.array([o[:t + n_new] for o in out], np.int32)
    return tokens, {"rounds": rounds, "drafted": drafted, "accepted": accepted,
                    "acceptance_rate": accepted / drafted if drafted else 0.0,
                    "tokens_per_round": (accepted + b * rounds) / (b * rounds) if rounds else 0.0}


def _probs(logits, temperature: float):
    return jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)


def _pick(logits, key, temperature: float):
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits.astype(jnp.float32) / temperature, axis=-1).astype(jnp.int32)


def speculative_steps(target: Steps, draft: Steps, k: int, temperature: float = 0.0) -> dict:
    """The jitted functions of one speculative round (caches donated)."""
    def prefill(steps):
        def fn(params, rest, tokens_bt, lengths_b, cache, key):
            logits, cache = steps.prefill(params, rest, tokens_bt, lengths_b, cache)
            return _pick(logits, key, temperature), cache
        return jax.jit(fn, donate_argnums=4)

    def one_round(tp, tr, dp, dr, cur_b, tcache, dcache, key):
        start_t, start_d = tcache["lengths"], dcache["lengths"]
        proposals, q, tok = [], [], cur_b
        for i in range(k + 1):  # the (k+1)-th feeds the last proposal in, so the draft's cache holds all k
            logits, dcache = draft.decode(dp, dr, tok, dcache)
            tok = _pick(logits, jax.random.fold_in(key, i), temperature)
            proposals.append(tok)
            q.append(_probs(logits, temperature) if temperature else None)
        d_bk = jnp.stack(proposals[:k], axis=1)
        logits_btv, tcache = target.verify(tp, tr, jnp.concatenate([cur_b[:, None], d_bk], axis=1), tcache)
        if temperature == 0:
            g_bt = jnp.argmax(logits_btv, axis=-1).astype(jnp.int32)  # the target's choice after each position
            keep_bk = g_bt[:, :k] == d_bk
            fix_b = lambda n_b: jnp.take_along_axis(g_bt, n_b[:, None], axis=1)[:, 0]
        else:
            p_btv = _probs(logits_btv, temperature)
            q_bkv = jnp.stack(q[:k], axis=1)
            p_d = jnp.take_along_axis(p_btv[:, :k], d_bk[..., None], axis=-1)[..., 0]
            q_d = jnp.take_along_axis(q_bkv, d_bk[..., None], axis=-1)[..., 0]
            u_bk = jax.random.uniform(jax.random.fold_in(key, k + 1), d_bk.shape)
            keep_bk = u_bk * q_d < p_d  # u < p/q, without dividing by a zero q
            # after a rejection at i: max(0, p_i − q_i); after all k accepted: p_k itself
            resid = jnp.concatenate([jnp.maximum(p_btv[:, :k] - q_bkv, 0.0), p_btv[:, k:]], axis=1)

            def fix_b(n_b):
                r = jnp.take_along_axis(resid, n_b[:, None, None], axis=1)[:, 0]
                return jax.random.categorical(jax.random.fold_in(key, k + 2), jnp.log(r + 1e-30), axis=-1)
        n_b = jnp.cumprod(keep_bk.astype(jnp.int32), axis=1).sum(axis=1)  # accepted proposals per row
        # emitted: the accepted proposals, then the target's own token at the first disagreement (or after all k)
        emitted = jnp.where(jnp.arange(k + 1)[None] < n_b[:, None], jnp.pad(d_bk, ((0, 0), (0, 1))),
                            fix_b(n_b).astype(jnp.int32)[:, None])
        tcache["lengths"] = start_t + n_b + 1
        dcache["lengths"] = start_d + n_b + 1
        return emitted, n_b, tcache, dcache

    return {"prefill_target": prefill(target), "prefill_draft": prefill(draft),
            "round": jax.jit(one_round, donate_argnums=(5, 6))}
