"""Loads a Hugging Face checkpoint (single or sharded safetensors) into CausalLM, strictly.

Every model tensor must be in the files with its shape and every tensor in the files must be used: a tensor
left over means the checkpoint computes something this engine does not (a bias, a norm, an expert), and
serving without it would give wrong logits with no error. Nothing is loaded unless everything matches.
"""
from __future__ import annotations

import torch
from safetensors import safe_open

from .config import CheckpointError, ModelConfig, weight_files
from .dtypes import DTYPES, SAFETENSORS_FLOATS, weight_dtype
from .model import CausalLM
from .rope import RotaryEmbedding

SHOWN = 5  # names quoted per kind of mismatch; the count says how many there are


def _listed(kind: str, names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f"{len(names)} tensors {kind}: {', '.join(names[:SHOWN])}{more}"


def check_tensors(cfg: ModelConfig, expected: dict[str, torch.Size], state: dict[str, torch.Tensor]) -> None:
    """Raises CheckpointError naming missing, extra, mis-shaped and non-float tensors (first few + counts)."""
    missing = sorted(expected.keys() - state.keys())
    extra = sorted(state.keys() - expected.keys())
    shapes = [f"{k} {list(state[k].shape)} (model: {list(expected[k])})" for k in sorted(expected.keys() & state.keys())
              if state[k].shape != expected[k]]
    ints = [f"{k} ({state[k].dtype})" for k in sorted(state) if not state[k].is_floating_point()]
    problems = [_listed(kind, names) for kind, names in (
        ("the model needs are missing (checkpoint lacks them)", missing),
        ("in the checkpoint are not used by the model (unsupported weights)", extra),
        ("have the wrong shape", shapes), ("are not floating point (quantized checkpoints are unsupported)", ints))
        if names]
    if problems:
        raise CheckpointError(f"{cfg.path}: checkpoint does not match {cfg.family} "
                              f"({cfg.num_hidden_layers} layers): " + "; ".join(problems))


def _check_saved_inv_freq(path: str, state: dict[str, torch.Tensor], ours: torch.Tensor) -> None:
    """Older Llama conversions saved each layer's rotary `inv_freq` buffer, which the config determines: it is
    taken out of the state, but only when it equals the frequencies computed from the config (a checkpoint that
    saved others was made with a rope the config does not describe)."""
    for name in [k for k in state if k.endswith(".rotary_emb.inv_freq")]:
        saved = state.pop(name)
        if saved.shape != ours.shape or not torch.allclose(saved.float(), ours, rtol=1e-3, atol=0):
            gap = float((saved.float() - ours).abs().max()) if saved.shape == ours.shape else float("nan")
            raise CheckpointError(f"{path}: {name} {list(saved.shape)} differs from the rotary frequencies config.json "
                                  f"describes ({list(ours.shape)}, largest difference {gap:.3g}): the checkpoint was "
                                  "made with a rope the config does not state")


def _headers(files: list[str]) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(name -> its file, name -> a meta tensor of its shape and dtype) from the headers alone: every check runs
    before a byte of weights is read. A dtype the engine does not serve reads as uint8 (refused as not float)."""
    where: dict[str, str] = {}
    metas: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt") as h:
            for name in h.keys():
                if name in where:
                    raise CheckpointError(f"{name} is in both {where[name]} and {f}")
                sl = h.get_slice(name)
                kind = SAFETENSORS_FLOATS.get(sl.get_dtype())
                dtype = torch.float64 if kind == "float64" else DTYPES.get(kind, torch.uint8)
                where[name] = f
                metas[name] = torch.empty(sl.get_shape(), dtype=dtype, device="meta")
    return where, metas


def _stored_dtypes(metas: dict[str, torch.Tensor]) -> set[str]:
    """The dtypes the weights are stored in (rotary inv_freq buffers of old conversions are no weights)."""
    return {str(m.dtype).removeprefix("torch.") for k, m in metas.items() if not k.endswith(".rotary_emb.inv_freq")}


def checkpoint_dtypes(path: str) -> set[str]:
    """What --dtype auto falls back on when config.json states none, from the headers alone (pdserve check)."""
    return _stored_dtypes(_headers(weight_files(path))[1])


def _read(file: str, name: str) -> torch.Tensor:
    with safe_open(file, framework="pt") as h:
        return h.get_tensor(name)


def _open_on(device: torch.device) -> str:
    """safetensors' own name of the device, so a shard's tensors are read straight onto it."""
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return "cpu" if device.type in ("cpu", "meta") else str(device)


def weight_nbytes(model: CausalLM) -> int:
    """Bytes of the served weights, a tied tensor counted once: what the checkpoint's tensors take in memory."""
    unique = {p.data_ptr(): p for p in model.parameters()}
    return sum(p.nbytes for p in unique.values())


def load_model(path: str, device: torch.device | str = "cpu", dtype: str | torch.dtype = "auto") -> CausalLM:
    """dtype: 'auto' keeps the checkpoint's (dtypes.weight_dtype), or a DTYPES name / torch dtype converts to it.
    Shard by shard, one tensor at a time, straight to the device and converted there: beside the loaded weights,
    no more than one tensor of the files is held, not a host copy of the checkpoint."""
    device = torch.device(device)
    if isinstance(dtype, torch.dtype):
        dtype = next(n for n, d in DTYPES.items() if d == dtype)
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    where, metas = _headers(weight_files(path))
    # rotary inv_freq is a non-persistent buffer (on meta so far): rebuild it, in float32 as transformers does
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    inv = [k for k in metas if k.endswith(".rotary_emb.inv_freq")]
    saved = {k: _read(where.pop(k), k) for k in inv}
    for k in inv:
        del metas[k]
    _check_saved_inv_freq(path, saved, rope.inv_freq)
    emb, head = "model.embed_tokens.weight", "lm_head.weight"
    tied = cfg.tie_word_embeddings and emb in metas
    if tied:
        # tied: lm_head is the embedding; a checkpoint may still carry the same tensor under lm_head
        if head in metas and not (metas[head].shape == metas[emb].shape and
                                  torch.equal(_read(where[head], head), _read(where[emb], emb))):
            raise CheckpointError(f"{path}: tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight")
        where.pop(head, None)
        metas[head] = metas[emb]
    check_tensors(cfg, {k: v.shape for k, v in model.state_dict().items()}, metas)
    name = weight_dtype(dtype, cfg.torch_dtype, _stored_dtypes(metas))
    target = DTYPES[name]
    # on the host safetensors hands out views of the file's mapped pages: a checkpoint rewritten under a running
    # service would change (truncated: fault) its weights, so each tensor is copied out before the next is read
    copy = device.type == "cpu"
    state: dict[str, torch.Tensor] = {}
    for f in dict.fromkeys(where.values()):
        with safe_open(f, framework="pt", device=_open_on(device)) as h:
            for k in [k for k, g in where.items() if g == f]:
                state[k] = h.get_tensor(k).to(device=device, dtype=target, copy=copy)
    if tied:
        state[head] = state[emb]
    model.load_state_dict(state, assign=True, strict=True)
    model.model.rotary_emb = rope
    model = model.to(device).eval()
    model.fuse()
    return model
