"""Small random GGUF files (llama, qwen2, qwen3, phi3, gemma2 and gemma3 architectures)
for the import's tests, written with ``gguf.GGUFWriter``
(F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 tensors quantized by ``gguf`` as
llama.cpp lays them out; Q2_K, Q3_K, Q4_K, Q5_K and Q6_K ones, which ``gguf`` cannot
quantize, as random blocks with finite fp16 scales: ``random_blocks``; Q/K rows permuted
as its converter permutes them), and an independent numpy forward pass in llama.cpp's
own convention (interleaved RoPE on the permuted rows), so the suite needs neither a real
model file nor torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["TinyLlama", "write_tiny_gguf", "bytes_to_unicode", "numpy_logits", "random_blocks", "BLOCK_FIELDS"]

#: type -> (bytes of a block, the fp16 scale fields: (byte offset, scale of a block of
#: weights about 1 in size, "d" or "dmin"))
BLOCK_FIELDS: dict[str, tuple[int, list[tuple[int, float, str]]]] = {
    "Q4_0": (18, [(0, 1 / 4.6, "d")]),
    "Q4_1": (20, [(0, 1 / 4.6, "d"), (2, -8 / 4.6, "m")]),
    "Q5_0": (22, [(0, 1 / 9.2, "d")]),
    "Q5_1": (24, [(0, 1 / 9.2, "d"), (2, -16 / 9.2, "m")]),
    "Q8_0": (34, [(0, 1 / 73, "d")]),
    "Q2_K": (84, [(80, 1 / 8, "d"), (82, 1.5 / 8, "dmin")]),
    "Q3_K": (110, [(108, 1 / 40, "d")]),
    "Q4_K": (144, [(0, 1 / 147, "d"), (2, 7.5 / 147, "dmin")]),
    "Q5_K": (176, [(0, 1 / 294, "d"), (2, 15.5 / 294, "dmin")]),
    "Q6_K": (210, [(208, 1 / 1150, "d")]),
}


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator, *, scale: float = 0.15,
                  spread: int = 0) -> np.ndarray:
    """A ``kind`` tensor [rows, cols] as raw block bytes [rows, bytes a row]: every byte
    random but the fp16 scales, set so the weights are about ``scale`` in size (each times
    a random power of two within 2^+-``spread``: scales and minimums of unlike exponents)."""
    size, fields = BLOCK_FIELDS[kind]
    per = 256 if kind.endswith("_K") else 32
    assert cols % per == 0, f"{kind} needs a multiple of {per} columns"
    n = rows * cols // per
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at, base, _ in fields:
        value = base * scale * rng.uniform(0.5, 1.0, n)
        if spread:
            value = value * 2.0 ** rng.integers(-spread, spread + 1, n)
        raw[:, at:at + 2] = value.astype(np.float16).reshape(n, 1).view(np.uint8)
    return raw.reshape(rows, cols // per * size)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (its byte-level BPE alphabet)."""
    from streamfleet.workers.logits import _bytes_to_unicode

    return _bytes_to_unicode()


class TinyLlama:
    """The random weights of one tiny model, as fp32 in llama.cpp's layout (Q/K permuted),
    after the round trip through their quantization types (what the file holds)."""

    def __init__(self, *, seed: int = 0, n_layer: int = 2, hidden: int = 64, n_head: int = 4, n_kv_head: int = 2,
                 intermediate: int = 96, tied: bool = True, rope_base: float = 10000.0, eps: float = 1e-5,
                 context: int = 128, qtype: str = "Q4_1", head_qtype: str = "Q8_0",
                 overrides: dict[str, str] | None = None, arch: str = "llama", head_dim: int | None = None,
                 attn_softcap: float = 0.0, final_softcap: float = 0.0, window: int = 0,
                 rope_base_swa: float | None = None, rope_scale: float = 1.0) -> None:
        from gguf import GGMLQuantizationType as T
        from gguf.quants import dequantize, quantize

        rng = np.random.default_rng(seed)
        byte_chars = list(bytes_to_unicode().values())
        merges = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or", "hell o"]
        self.tokens = SPECIALS + byte_chars + [m.replace(" ", "") for m in merges]
        self.token_types = [3] * len(SPECIALS) + [1] * (len(self.tokens) - len(SPECIALS))
        self.merges = merges
        self.vocab = len(self.tokens)
        self.n_layer, self.hidden, self.n_head, self.n_kv_head = n_layer, hidden, n_head, n_kv_head
        self.arch = arch
        # gemma2/gemma3 (written as metadata by ``write_tiny_gguf``): soft-capping, the sliding
        # window, gemma3's RoPE base of its sliding-window layers
        self.attn_softcap, self.final_softcap, self.window, self.rope_base_swa = (attn_softcap, final_softcap,
                                                                                   window, rope_base_swa)
        self.rope_scale = rope_scale  # linear RoPE scaling: positions divided by it
        self.head_dim = head_dim or hidden // n_head
        qd = n_head * self.head_dim
        self.intermediate, self.tied, self.rope_base = intermediate, tied, rope_base
        self.eps, self.context = eps, context
        kinds = {name: T[name] for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K",
                                            "Q3_K", "Q4_K", "Q5_K", "Q6_K")}
        self.tensors: dict[str, tuple[np.ndarray, Any]] = {}  # name -> (stored data, type)
        self.values: dict[str, np.ndarray] = {}  # name -> fp32 as the file holds it

        def put(name: str, value: np.ndarray, kind: str) -> None:
            kind = (overrides or {}).get(name.split(".", 2)[-1].removesuffix(".weight"), kind)
            t = kinds[kind]
            value = value.astype(np.float32)
            if kind.endswith("_K"):  # gguf quantizes no K type: random blocks of about the same size
                data = random_blocks(kind, *value.shape, rng, scale=float(np.std(value)))
            else:
                data = value if t == T.F32 else quantize(value, t)
            self.tensors[name] = (data, t)
            self.values[name] = value if t == T.F32 else dequantize(data, t).reshape(value.shape)

        def mat(rows: int, cols: int, scale: float = 0.15) -> np.ndarray:
            w = rng.normal(0.0, scale, size=(rows, cols))
            w[:, :32] += rng.normal(0.0, scale, size=(rows, 1))  # blocks with an offset: Q4_1's minimum matters
            return w

        put("token_embd.weight", mat(self.vocab, hidden, 0.5), head_qtype)
        kv = n_kv_head * self.head_dim
        for i in range(n_layer):
            put(f"blk.{i}.attn_norm.weight", 1.0 + rng.normal(0, 0.1, hidden), "F32")
            put(f"blk.{i}.ffn_norm.weight", 1.0 + rng.normal(0, 0.1, hidden), "F32")
            if arch == "phi3":  # one Q|K|V matrix, one gate|up matrix (llama.cpp's phi3 tensors)
                put(f"blk.{i}.attn_qkv.weight", np.concatenate([mat(qd, hidden), mat(kv, hidden), mat(kv, hidden)]),
                    qtype)
            else:
                put(f"blk.{i}.attn_q.weight", mat(qd, hidden), qtype)
                put(f"blk.{i}.attn_k.weight", mat(kv, hidden), qtype)
                put(f"blk.{i}.attn_v.weight", mat(kv, hidden), qtype)
            put(f"blk.{i}.attn_output.weight", mat(hidden, qd), qtype)
            if arch == "phi3":
                put(f"blk.{i}.ffn_up.weight", np.concatenate([mat(intermediate, hidden), mat(intermediate, hidden)]),
                    qtype)
            else:
                put(f"blk.{i}.ffn_gate.weight", mat(intermediate, hidden), qtype)
                put(f"blk.{i}.ffn_up.weight", mat(intermediate, hidden), qtype)
            put(f"blk.{i}.ffn_down.weight", mat(hidden, intermediate), qtype)
            if arch == "qwen2":  # biases on Q, K and V (F32, as llama.cpp's converter keeps 1-D tensors)
                for name, n in (("attn_q", qd), ("attn_k", kv), ("attn_v", kv)):
                    put(f"blk.{i}.{name}.bias", rng.normal(0, 0.5, n), "F32")
            if arch in ("qwen3", "gemma3"):  # per-head RMSNorm weights of Q and K
                put(f"blk.{i}.attn_q_norm.weight", 1.0 + rng.normal(0, 0.2, self.head_dim), "F32")
                put(f"blk.{i}.attn_k_norm.weight", 1.0 + rng.normal(0, 0.2, self.head_dim), "F32")
            if arch in ("gemma2", "gemma3"):  # RMSNorms of the attention's and feed-forward's outputs
                put(f"blk.{i}.post_attention_norm.weight", 1.0 + rng.normal(0, 0.1, hidden), "F32")
                put(f"blk.{i}.post_ffw_norm.weight", 1.0 + rng.normal(0, 0.1, hidden), "F32")
        put("output_norm.weight", 1.0 + rng.normal(0, 0.1, hidden), "F32")
        if not tied:
            put("output.weight", mat(self.vocab, hidden, 0.5), head_qtype)


def write_tiny_gguf(path: Path, model: TinyLlama, *, arch: str = "llama", pre: str = "smollm",
                    extra: dict[str, Any] | None = None, extra_tensors: dict[str, np.ndarray] | None = None,
                    tokenizer_model: str = "gpt2", template: str | None = TEMPLATE) -> Path:
    """Write ``model`` as a GGUF file; ``extra`` adds metadata (key -> value)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny random llama")
    w.add_block_count(model.n_layer)
    w.add_context_length(model.context)
    w.add_embedding_length(model.hidden)
    w.add_feed_forward_length(model.intermediate)
    w.add_head_count(model.n_head)
    w.add_head_count_kv(model.n_kv_head)
    w.add_rope_freq_base(model.rope_base)
    w.add_layer_norm_rms_eps(model.eps)
    w.add_rope_dimension_count(model.head_dim)
    if model.head_dim * model.n_head != model.hidden:
        w.add_key_length(model.head_dim)
        w.add_value_length(model.head_dim)
    if model.attn_softcap:
        w.add_attn_logit_softcapping(model.attn_softcap)
    if model.final_softcap:
        w.add_final_logit_softcapping(model.final_softcap)
    if model.window:
        w.add_sliding_window(model.window)
    if model.rope_scale != 1.0:
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        w.add_float32(f"{arch}.rope.scaling.factor", model.rope_scale)
    if model.rope_base_swa is not None:
        w.add_float32(f"{arch}.rope.freq_base_swa", model.rope_base_swa)
    w.add_vocab_size(model.vocab)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(model.tokens)
    w.add_token_types(model.token_types)
    w.add_token_merges(model.merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    if template:
        w.add_chat_template(template)
    for key, value in (extra or {}).items():
        if isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, str(value))
    for name, (data, kind) in model.tensors.items():
        w.add_tensor(name, data, raw_dtype=kind)
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _rope_interleaved(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """llama.cpp's RoPE (mode 0): pairs (2i, 2i+1) of each head rotated by pos * base^(-2i/d).
    ``x``: [S, heads, d]."""
    d = x.shape[-1]
    theta = positions[:, None].astype(np.float64) * base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def _rope_half(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """RoPE on halves (transformers' rotate_half, llama.cpp's NEOX mode): element i of a head
    and element i + d/2 rotated by pos * base^(-2i/d). ``x``: [S, heads, d]."""
    d = x.shape[-1]
    theta = positions[:, None].astype(np.float64) * base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)


def numpy_logits(model: TinyLlama, ids: list[int]) -> np.ndarray:
    """Logits [len(ids), vocab] of one sequence from position 0, in float64, from each
    architecture's definition on the tensors as the file holds them: llama (Q/K rows in
    llama.cpp's permuted order, interleaved RoPE), qwen2 (Q/K/V biases), qwen3 (RMSNorm of
    each head of Q and K before RoPE), phi3 (one Q|K|V and one gate|up matrix), gemma2
    (embeddings times sqrt(hidden), norms after the attention and the feed-forward, GELU,
    soft-capped scores and logits, sliding-window layers), gemma3 (gemma2 with Q/K norms and
    the sliding layers' own RoPE base); the others rotate halves."""
    v = {k: a.astype(np.float64) for k, a in model.values.items()}
    nh, kvh, hd = model.n_head, model.n_kv_head, model.head_dim
    s = len(ids)
    pos = np.arange(s)
    rope = _rope_interleaved if model.arch == "llama" else _rope_half
    gemma = model.arch in ("gemma2", "gemma3")

    def norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        # gemma's RMSNorm multiplies by (1 + w); llama.cpp's converter stores 1 + w, the file's w here
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + model.eps) * w

    def cap(z: np.ndarray, c: float) -> np.ndarray:
        return np.tanh(z / c) * c if c else z

    x = v["token_embd.weight"][ids]
    if gemma:
        x = x * np.sqrt(model.hidden)
    for i in range(model.n_layer):
        # gemma: every 2nd (gemma2) or 6th (gemma3) layer global, the others attend to the
        # last ``window`` positions only
        period = {"gemma2": 2, "gemma3": 6}.get(model.arch, 0)
        sliding = bool(model.window) and (not period or (i + 1) % period != 0)
        q_pos, k_pos = pos[:, None], pos[None, :]
        causal = (k_pos <= q_pos) & (~sliding | (q_pos - k_pos < max(model.window, 1)))
        base = model.rope_base_swa if sliding and model.rope_base_swa is not None else model.rope_base
        # linear scaling: positions divided by the factor (gemma3: in its global layers only)
        scaled = pos / (1.0 if sliding and model.rope_base_swa is not None else model.rope_scale)
        p = f"blk.{i}."
        h = norm(x, v[p + "attn_norm.weight"])
        if model.arch == "phi3":
            wq, wk, wv = np.split(v[p + "attn_qkv.weight"], [nh * hd, (nh + kvh) * hd])
        else:
            wq, wk, wv = (v[p + f"attn_{n}.weight"] for n in "qkv")
        q, k, val = h @ wq.T, h @ wk.T, h @ wv.T
        if model.arch == "qwen2":
            q, k, val = q + v[p + "attn_q.bias"], k + v[p + "attn_k.bias"], val + v[p + "attn_v.bias"]
        q, k, val = q.reshape(s, nh, hd), k.reshape(s, kvh, hd), val.reshape(s, kvh, hd)
        if model.arch in ("qwen3", "gemma3"):
            q, k = norm(q, v[p + "attn_q_norm.weight"]), norm(k, v[p + "attn_k_norm.weight"])
        q, k = rope(q, scaled, base), rope(k, scaled, base)
        ctx = np.empty((s, nh, hd))
        for head in range(nh):
            g = head // (nh // kvh)
            scores = cap(q[:, head] @ k[:, g].T / np.sqrt(hd), model.attn_softcap)
            scores = np.where(causal, scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            ctx[:, head] = probs @ val[:, g]
        attn = ctx.reshape(s, nh * hd) @ v[p + "attn_output.weight"].T
        x = x + (norm(attn, v[p + "post_attention_norm.weight"]) if gemma else attn)
        f = norm(x, v[p + "ffn_norm.weight"])
        if model.arch == "phi3":
            w_gate, w_up = np.split(v[p + "ffn_up.weight"], 2)
        else:
            w_gate, w_up = v[p + "ffn_gate.weight"], v[p + "ffn_up.weight"]
        gate = f @ w_gate.T
        if gemma:  # GELU, tanh form
            act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))
        else:  # SiLU
            act = gate / (1 + np.exp(-gate))
        y = (act * (f @ w_up.T)) @ v[p + "ffn_down.weight"].T
        x = x + (norm(y, v[p + "post_ffw_norm.weight"]) if gemma else y)
    x = norm(x, v["output_norm.weight"])
    out = v["token_embd.weight"] if model.tied else v["output.weight"]
    return cap(x @ out.T, model.final_softcap)
