"""SGLang's memory-ratio arithmetic: how many state slots a request holds, and the state : KV ratio that balances
the two pools for an average request length (serving-recipes.md section 2).

    ratio = (S + D) x state_bytes_per_rank / (L x (kv_bytes_per_token / dcp + draft_kv_bytes_per_token))

S: state slots per running request (radix strategy, overlap scheduling, PD role); D: speculative verify states;
L: average request length (input + output tokens). Everything here is per rank of one attention-TP group.

Where SGLang's runtime counts differently from the page's calculator, this module follows the runtime and says so:
D under DFLASH is the block size (`_handle_dflash` sets --speculative-num-draft-tokens to it), and the draft's KV
per token is the draft's own (`CacheSettings.draft_kv_bytes`), not DSPARK's measured constant. The ReplaySSM ring
(`replayssm_ring_bytes_per_layer`) is charged per state slot, and the conv verify windows ReplaySSM keeps per running
request, by the runtime's pool sizing (pools.py); the page's ratio leaves both out, and so does `balanced_ratio`, so
pinned ratios stay the page's.
"""

from __future__ import annotations

from dataclasses import dataclass

RADIX_STRATEGIES = ("extra_buffer", "extra_buffer_lazy", "no_buffer", "off")
MODES = ("unified", "prefill", "decode")
SPEC_MODES = ("none", "mtp", "dflash")
KV_DTYPE_CHOICES = ("bf16", "fp8", "fp32")
SSM_DTYPE_CHOICES = ("fp32", "bf16")
KV_LAYOUTS = ("sglang", "kestrel")


@dataclass(frozen=True)
class CacheSettings:
    """The serving settings the ratio depends on, with SGLang's defaults."""

    kv_dtype: str = "bf16"
    kv_layout: str = "sglang"               # fp8 scales: per tensor (sglang) or per token and row (kestrel)
    ssm_dtype: str = "fp32"
    radix_strategy: str = "extra_buffer"
    overlap_schedule: bool = True
    skip_decode_lock: bool = False          # SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1
    mode: str = "unified"
    spec: str = "none"
    draft_tokens: int = 0                   # speculative block size (DSPARK 7, DFLASH 8)
    draft_kv_bytes: int | None = None       # the draft's KV per token (replicated); None: the draft model's
    replay_ssm: bool = False                # --enable-linear-replayssm-spec
    replay_cache_len: int = 16              # --linear-replayssm-cache-len (SGLang's default)

    @property
    def row_scales(self) -> bool:
        """Whether FP8 KV carries a scale per token and row (kestrel's layout)."""
        return self.kv_layout == "kestrel"

    def check(self) -> None:
        """Raise a ValueError for a setting outside its choices."""
        for name, value, choices in (("kv dtype", self.kv_dtype, KV_DTYPE_CHOICES),
                                     ("kv layout", self.kv_layout, KV_LAYOUTS),
                                     ("ssm dtype", self.ssm_dtype, SSM_DTYPE_CHOICES),
                                     ("radix strategy", self.radix_strategy, RADIX_STRATEGIES),
                                     ("mode", self.mode, MODES), ("spec", self.spec, SPEC_MODES)):
            if value not in choices:
                raise ValueError(f"unknown {name} {value!r}; choose one of: {', '.join(choices)}.")
        if self.spec != "none" and self.draft_tokens < 1:
            raise ValueError(f"--draft-tokens must be at least 1 with --spec {self.spec}, got {self.draft_tokens}.")
        if self.draft_kv_bytes is not None and self.draft_kv_bytes < 0:
            raise ValueError(f"--draft-kv-bytes must not be negative, got {self.draft_kv_bytes}.")
        if self.replay_cache_len < 1:
            raise ValueError(f"--replay-cache-len must be at least 1, got {self.replay_cache_len}.")
        if self.radix_strategy == "no_buffer" and self.overlap_schedule:
            raise ValueError("the no_buffer radix strategy runs without the overlap scheduler (SGLang's "
                             "mamba_hook.validate_mamba_no_buffer; it also needs --page-size 1 and an attention "
                             "backend other than trtllm_mha); add --disable-overlap-schedule or pick another strategy.")
        if self.radix_strategy == "extra_buffer_lazy" and not self.overlap_schedule:
            raise ValueError("the extra_buffer_lazy radix strategy needs the overlap scheduler; drop "
                             "--disable-overlap-schedule or pick another strategy.")


def slots_per_request(settings: CacheSettings, pp: int = 1) -> int:
    """S: state slots one running request holds (SGLang's _calculate_mamba_ratio, as the calculator mirrors it).

    PD decode (chunk cache) and a disabled radix cache hold 1; no_buffer holds 3; the extra-buffer strategies hold
    3 (2 with the decode-lock skip) plus a ping-pong track buffer of 2 under overlap scheduling, 1 when lazy or
    without overlap (pipeline parallelism turns overlap off).
    """
    if settings.mode == "decode" or settings.radix_strategy == "off":
        return 1
    if settings.radix_strategy == "no_buffer":
        return 3
    overlap = settings.overlap_schedule and pp == 1
    track = 1 if (not overlap or settings.radix_strategy == "extra_buffer_lazy") else 2
    return 3 - int(settings.skip_decode_lock) + track


def verify_width(settings: CacheSettings) -> int:
    """Tokens one verify step checks per sequence (1 without speculation). DSPARK verifies its block + 1 (the
    page's calculator: 8 at block 7); DFLASH verifies its block (SGLang's speculative_hook._handle_dflash sets
    --speculative-num-draft-tokens to --speculative-dflash-block-size)."""
    if settings.spec == "none":
        return 1
    return settings.draft_tokens + (1 if settings.spec == "mtp" else 0)


def verify_states(settings: CacheSettings) -> int:
    """D: the intermediate states speculative verification keeps per request (one per verified token), unless
    ReplaySSM folds them away or the server is a PD prefill (it never verifies)."""
    if settings.spec == "none" or settings.replay_ssm or settings.mode == "prefill":
        return 0
    return verify_width(settings)


def draft_kv_bytes_per_token(settings: CacheSettings) -> int:
    """The draft model's KV per token per rank (replicated, so DCP does not divide it); 0 without speculation."""
    if settings.spec == "none":
        return 0
    if settings.draft_kv_bytes is None:
        raise ValueError(f"the draft's KV bytes per token under --spec {settings.spec} are not known; give "
                         "--draft-kv-bytes N.")
    return settings.draft_kv_bytes


def replayssm_ring_bytes_per_layer(heads: int, head_dim: int, record_len: int, activation_bytes: int) -> int:
    """One KDA layer's ReplaySSM ring for one state slot, as SGLang allocates it for KDA
    (KimiLinearCacheParams.replayssm_ring_bytes_per_req): raw v, raw k and the chunked d and k rings in the
    activation dtype, the per-K gate g and beta in fp32, each `record_len` steps long."""
    activations = 4 * heads * record_len * head_dim * activation_bytes
    gate = heads * record_len * head_dim * 4
    beta = heads * record_len * 4
    return activations + gate + beta


def kv_bytes_per_token_per_rank(kv_bytes_per_token: int, dcp: int, settings: CacheSettings) -> float:
    """KV bytes one logical token costs each rank: the model's KV split over DCP ranks, plus the draft's."""
    return kv_bytes_per_token / dcp + draft_kv_bytes_per_token(settings)


def balanced_ratio(slots: int, verify: int, state_bytes_per_rank: int, kv_bytes_per_rank: float,
                   avg_request_len: int) -> float:
    """The state : KV memory ratio at which both pools fill at the same number of requests of avg_request_len."""
    if avg_request_len < 1:
        raise ValueError(f"the average request length must be at least 1 token, got {avg_request_len}.")
    return (slots + verify) * state_bytes_per_rank / (avg_request_len * kv_bytes_per_rank)


def ratio_text(ratio: float) -> str:
    """The ratio as SGLang's calculator prints it into --mamba-full-memory-ratio (1 decimal from 10, 2 decimals
    from 1, else 2 significant digits; trailing zeros dropped)."""
    if ratio >= 10:
        text = f"{ratio:.1f}"
        return text[:-2] if text.endswith(".0") else text
    if ratio >= 1:
        return f"{ratio:.2f}".rstrip("0").rstrip(".")
    return repr(float(f"{ratio:.2g}"))
