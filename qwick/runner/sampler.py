"""Batched token sampling: logprobs, logit bias, min_tokens, penalties, greedy / temperature / top-k /
top-p / min-p, and per-request seeds.

The order follows vLLM v1:

1. logprobs from the raw logits (log_softmax before any processing): the sampled token's logprob and rank,
   and the top-k (k = the most logprobs any row asked for);
2. the grammar bitmask of rows with structured output (tokens the grammar forbids get -inf; only those
   rows pay for it, a batch without any pays nothing), then logit_bias, then min_tokens masking (stop ids
   get -inf while num_output_tokens < min_tokens), then penalties (repetition over prompt + output,
   HF/vLLM semantics; presence/frequency over output only, OpenAI semantics);
3. greedy rows take the argmax; the other rows: temperature, top-k, top-p, min-p, then an exponential race
   (argmax(probs / q), q ~ Exp(1)), which samples from probs without torch.multinomial's host sync. On
   CUDA, rows without top-k/top-p/min-p run the race in one fused pass (`qwick.kernels.sampling.
   race_sample`: argmax(logit / t - log q), the same token), ~0.7 ms less per step at batch 256. On the
   CPU, top-p looks for each row's nucleus among its 1024 largest logits before sorting the vocabulary
   (`_top_p_among_candidates`: the chat page's top_p 0.8 cost the demo model 10.6 ms a step, now 1.4).

`SamplingMetadata.build` walks the sampling rows once per step (Python work per request, never per
vocabulary entry) and sets flags so that a batch of greedy rows with no penalties costs one argmax.
Nothing in `Sampler.__call__` reads a device value back to the host: the caller's `.tolist()` of the
sampled ids is the only sync.

Seeds: the noise of a seeded row is a function of a hash of (seed, output position) alone (a torch.Generator
reseeded per row on the CPU; one Philox kernel for all seeded rows on CUDA), so the row's draw does not
depend on what else is in the batch, on row order, or on preemption and recompute. Unseeded rows share the
sampler's generator. (The CPU and CUDA noise differ, so a seed gives the same output on every run on the
same kind of device, not across device kinds.)
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from qwick.core.request import Request
from qwick.device_upload import to_device

_EPS = 1e-5
_MASK64 = (1 << 64) - 1
# The most top logprobs a request may ask for through the server (OpenAI's bound, MAX_TOP_LOGPROBS in
# qwick.server.protocol); the memory profile samples with this many. The offline LLM takes more, whose
# topk buffers grow with k: near k = vocab they come close to the peak of top-p's sort.
MAX_NUM_LOGPROBS = 20


def seed_for_position(seed: int, position: int) -> int:
    """A 63-bit generator seed from a request seed and the output position being sampled (splitmix64)."""
    x = ((seed & _MASK64) ^ (((position + 1) * 0x9E3779B97F4A7C15) & _MASK64)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x & ((1 << 63) - 1)


def _pad(rows: Sequence[Sequence[int]], pad: int) -> list[list[int]]:
    width = max((len(r) for r in rows), default=0)
    return [list(r) + [pad] * (width - len(r)) for r in rows]


# Columns of `_static_row` after the eight per-row values: flags, so that any() over a column is C-speed.
_C_TOP_K, _C_TOP_P, _C_MIN_P, _C_TEMP, _C_PRES, _C_FREQ, _C_REP, _C_DYNAMIC = range(8, 16)
_NUM_COLS = 16


def _static_row(request: Request, V: int) -> tuple:
    """A request's sampling settings that never change during its life, as one row of
    `SamplingMetadata.build`'s columns: temperature, greedy, top_k, top_p, min_p, the three penalties,
    then flags: the top-k to apply (0: none), top-p / min-p / temperature != 1 / each penalty in use, and
    whether the row needs `build`'s per-step pass (seed, logit_bias, min_tokens, logprobs).
    Cached on the request, keyed by its params object."""
    sp = request.sampling_params
    cached = request.sampling_cache
    if cached is not None and cached[0] is sp and cached[1] == V:
        return cached[2]
    is_greedy = sp.temperature < _EPS
    pres, freq, rep = float(sp.presence_penalty), float(sp.frequency_penalty), float(sp.repetition_penalty)
    flags_p = (abs(pres) > _EPS, abs(freq) > _EPS, abs(rep - 1.0) > _EPS)
    dynamic = bool(sp.logit_bias) or sp.min_tokens > 0 or sp.logprobs is not None
    if is_greedy:
        row = (1.0, True, V, 1.0, 0.0, pres, freq, rep, 0, False, False, False, *flags_p, dynamic)
    else:
        k = sp.top_k if 0 < sp.top_k < V else V
        row = (
            float(sp.temperature),
            False,
            k,
            float(sp.top_p),
            float(sp.min_p),
            pres,
            freq,
            rep,
            k if k < V else 0,
            sp.top_p < 1.0 - _EPS,
            sp.min_p > _EPS,
            abs(sp.temperature - 1.0) > _EPS,
            *flags_p,
            dynamic or sp.seed is not None,
        )
    request.sampling_cache = (sp, V, row)
    return row


def _indices(flags: Sequence[bool]) -> list[int]:
    return [i for i, f in enumerate(flags) if f] if any(flags) else []


@dataclass
class LogprobsTensors:
    """Logprobs of one step, vLLM's layout: column 0 is the sampled token, columns 1..k the top-k.

    All values come from the raw logits (before bias, penalties, temperature and truncation).
    Rows that asked for fewer than k logprobs (or none) get k as well; the caller slices.
    """

    logprob_token_ids: torch.Tensor  # [B, k + 1] long
    logprobs: torch.Tensor  # [B, k + 1] float32
    selected_token_ranks: torch.Tensor  # [B] long; 1 = most likely (1 + number of strictly larger)

    @property
    def sampled_logprobs(self) -> torch.Tensor:
        return self.logprobs[:, 0]

    @property
    def topk_token_ids(self) -> torch.Tensor:
        return self.logprob_token_ids[:, 1:]

    @property
    def topk_logprobs(self) -> torch.Tensor:
        return self.logprobs[:, 1:]

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        return (
            self.logprob_token_ids.tolist(),
            self.logprobs.tolist(),
            self.selected_token_ranks.tolist(),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] long, on the logits' device
    logprobs: LogprobsTensors | None = None

    def to_host_async(self) -> SamplerOutput:
        """A copy in pinned host memory, queued behind the work that computes it (CUDA; returns self
        elsewhere). Reading it needs the stream to have reached the copy: record an event after this."""
        if not self.sampled_token_ids.is_cuda:
            return self

        def host(t: torch.Tensor) -> torch.Tensor:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)

        lp = self.logprobs
        if lp is not None:
            lp = LogprobsTensors(host(lp.logprob_token_ids), host(lp.logprobs), host(lp.selected_token_ranks))
        return SamplerOutput(host(self.sampled_token_ids), lp)


@dataclass
class SamplingMetadata:
    """Batched sampling settings for the rows that sample this step, in batch row order.

    Every optional tensor is None when no row needs it; the matching op is then skipped.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # [B] float32; greedy rows hold 1.0. None when all rows are greedy or every temperature is 1.
    temperature: torch.Tensor | None
    # [B] bool, True for greedy rows; None unless the batch mixes greedy and random rows.
    greedy_mask: torch.Tensor | None
    top_k: torch.Tensor | None  # [B] long, vocab_size where a row has no top-k
    max_top_k: int  # host-side max of top_k (so torch.topk needs no sync); 0 when top_k is None
    top_p: torch.Tensor | None  # [B] float32, 1.0 where a row has no top-p
    min_p: torch.Tensor | None  # [B] float32, 0.0 where a row has no min-p
    # Penalties. Token-id tensors are padded with vocab_size.
    presence_penalties: torch.Tensor | None  # [B] float32
    frequency_penalties: torch.Tensor | None  # [B] float32
    repetition_penalties: torch.Tensor | None  # [B] float32
    prompt_token_ids: torch.Tensor | None  # [B, Lp] long; only when repetition penalties apply
    output_token_ids: torch.Tensor | None  # [B, Lo] long; when any penalty applies
    # logit_bias as a sparse triple (row, token, bias).
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # min_tokens: (row, token) pairs to set to -inf this step.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None
    # Seeded rows (host-side): row indices and the generator seed for this step's draw of each.
    seeded_rows: list[int]
    seeded_generator_seeds: list[int]
    max_num_logprobs: int | None  # None: no row wants logprobs
    # Structured output: an int32 [B, ceil(V / 32)] bitmask (bit set = allowed), on the logits' device,
    # and the rows it applies to. None / empty when no row has a grammar.
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: list[int] = field(default_factory=list)

    @property
    def no_penalties(self) -> bool:
        return (
            self.presence_penalties is None
            and self.frequency_penalties is None
            and self.repetition_penalties is None
        )

    @classmethod
    def build(
        cls, requests: Sequence[Request], vocab_size: int, device: torch.device | str = "cpu"
    ) -> SamplingMetadata:
        device = torch.device(device)
        n = len(requests)
        V = vocab_size

        # Per-request constants come from a cache on the request (computed at its first sampling step), so
        # a step's Python work per row is a lookup plus the few settings that change from step to step.
        rows = [_static_row(req, V) for req in requests]
        cols = list(zip(*rows)) if rows else [()] * _NUM_COLS
        temps, greedy, top_k, top_p, min_p, pres, freq, rep = cols[:8]
        any_top_k, any_top_p, any_min_p = any(cols[_C_TOP_K]), any(cols[_C_TOP_P]), any(cols[_C_MIN_P])
        any_pres, any_freq, any_rep = any(cols[_C_PRES]), any(cols[_C_FREQ]), any(cols[_C_REP])
        max_top_k = max(cols[_C_TOP_K], default=0)
        all_temp_one = not any(cols[_C_TEMP])

        bias_rows: list[int] = []
        bias_toks: list[int] = []
        bias_vals: list[float] = []
        mt_rows: list[int] = []
        mt_toks: list[int] = []
        seeded_rows: list[int] = []
        seeded_seeds: list[int] = []
        max_num_logprobs: int | None = None
        for i in _indices(cols[_C_DYNAMIC]):  # rows with a seed, logit_bias, min_tokens or logprobs
            req = requests[i]
            sp = req.sampling_params
            if sp.seed is not None and not greedy[i]:
                seeded_rows.append(i)
                seeded_seeds.append(seed_for_position(sp.seed, req.sample_index))
            if sp.logit_bias:
                for tok, b in sp.logit_bias.items():
                    if 0 <= tok < V:  # out-of-range ids are the API layer's to reject; never crash here
                        bias_rows.append(i)
                        bias_toks.append(tok)
                        bias_vals.append(b)
            if req.sample_index < sp.min_tokens:
                for tok in sp.all_stop_token_ids:
                    if 0 <= tok < V:
                        mt_rows.append(i)
                        mt_toks.append(tok)
            if sp.logprobs is not None:
                max_num_logprobs = max(max_num_logprobs or 0, sp.logprobs)
        grammar_rows = [i for i, req in enumerate(requests) if req.structured_output is not None]

        def t(data, dtype):
            return to_device(data, dtype, device)

        num_greedy = sum(greedy)
        all_greedy = num_greedy == n
        all_random = num_greedy == 0
        if all_greedy:
            any_top_k = any_top_p = any_min_p = False
            seeded_rows, seeded_seeds = [], []

        out_ids = prompt_ids = None
        if any_pres or any_freq or any_rep:
            out_ids = t(_pad([r.output_token_ids for r in requests], V), torch.long)
        if any_rep:
            prompt_ids = t(_pad([r.prompt_token_ids for r in requests], V), torch.long)

        bitmask = None
        if grammar_rows:
            # Filled on the host by each row's matcher; unconstrained rows keep all bits set (unused).
            bitmask = torch.full((n, (V + 31) // 32), -1, dtype=torch.int32)
            for i in grammar_rows:
                requests[i].structured_output.fill_bitmask(bitmask, i)
            bitmask = to_device(bitmask, torch.int32, device)

        return cls(
            num_rows=n,
            vocab_size=V,
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=None if all_greedy or all_temp_one else t(temps, torch.float32),
            greedy_mask=None if all_greedy or all_random else t(greedy, torch.bool),
            top_k=t(top_k, torch.long) if any_top_k else None,
            max_top_k=max_top_k if any_top_k else 0,
            top_p=t(top_p, torch.float32) if any_top_p else None,
            min_p=t(min_p, torch.float32) if any_min_p else None,
            presence_penalties=t(pres, torch.float32) if any_pres else None,
            frequency_penalties=t(freq, torch.float32) if any_freq else None,
            repetition_penalties=t(rep, torch.float32) if any_rep else None,
            prompt_token_ids=prompt_ids,
            output_token_ids=out_ids,
            logit_bias=(
                (t(bias_rows, torch.long), t(bias_toks, torch.long), t(bias_vals, torch.float32))
                if bias_rows
                else None
            ),
            min_tokens_mask=(t(mt_rows, torch.long), t(mt_toks, torch.long)) if mt_rows else None,
            seeded_rows=seeded_rows,
            seeded_generator_seeds=seeded_seeds,
            max_num_logprobs=max_num_logprobs,
            grammar_bitmask=bitmask,
            grammar_rows=grammar_rows,
        )

    @classmethod
    def worst_case(
        cls, num_rows: int, vocab_size: int, max_len: int, device: torch.device | str = "cpu"
    ) -> SamplingMetadata:
        """The settings under which sampling `num_rows` rows needs the most memory, for the runner's memory
        profile: every feature on (temperature, top-k with top-p, min-p, the three penalties over prompt
        and output ids `max_len` wide, logit bias, min_tokens, seeds on half the rows, MAX_NUM_LOGPROBS).

        The grammar bitmask is left out: applying it needs xgrammar, and its int32 [rows, vocab / 32] is
        1/32 of one logits tensor, where the sampler holds about ten of those at its peak.
        """
        device = torch.device(device)
        n, V = num_rows, vocab_size
        rows = torch.arange(n, device=device)

        def full(value, dtype=torch.float32) -> torch.Tensor:
            return torch.full((n,), value, dtype=dtype, device=device)

        ids = (torch.arange(n * max_len, device=device) % V).view(n, max_len)  # no RNG state consumed
        seeded = list(range(0, n, 2))
        return cls(
            num_rows=n,
            vocab_size=V,
            all_greedy=False,
            all_random=True,
            temperature=full(0.7),
            greedy_mask=None,
            top_k=full(max(1, min(50, V - 1)), torch.long),
            max_top_k=max(1, min(50, V - 1)),
            top_p=full(0.9),
            min_p=full(0.05),
            presence_penalties=full(0.5),
            frequency_penalties=full(0.5),
            repetition_penalties=full(1.1),
            prompt_token_ids=ids,
            output_token_ids=ids,
            logit_bias=(rows, torch.zeros_like(rows), full(1.0)),
            min_tokens_mask=(rows, torch.zeros_like(rows)),
            seeded_rows=seeded,
            seeded_generator_seeds=[seed_for_position(i, 0) for i in seeded],
            max_num_logprobs=MAX_NUM_LOGPROBS,
        )


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, every logit a row's grammar forbids (xgrammar's kernel: C++ on the CPU,
    Triton on GPUs). Only reached when some row has a grammar, so xgrammar is imported only then."""
    from xgrammar import apply_token_bitmask_inplace

    apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] token ids padded with vocab_size -> [B, V] occurrence counts."""
    counts = torch.zeros((token_ids.shape[0], vocab_size + 1), dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones(token_ids.shape, dtype=torch.float32, device=counts.device))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output; divide positive logits, multiply negative ones), then frequency
    (minus penalty * count in the output) and presence (minus penalty if in the output). In place."""
    V = logits.shape[1]
    assert meta.output_token_ids is not None
    out_counts = _bin_counts(meta.output_token_ids, V)
    if meta.repetition_penalties is not None:
        assert meta.prompt_token_ids is not None
        seen = torch.zeros((logits.shape[0], V + 1), dtype=torch.bool, device=logits.device)
        seen.scatter_(1, meta.prompt_token_ids, True)
        seen = seen[:, :V] | (out_counts > 0)
        rp = meta.repetition_penalties.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalized, logits)
    if meta.frequency_penalties is not None:
        logits = logits - meta.frequency_penalties.unsqueeze(1) * out_counts
    if meta.presence_penalties is not None:
        logits = logits - meta.presence_penalties.unsqueeze(1) * (out_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p leave out, for all rows at once.

    Top-k keeps every token whose logit is >= the row's k-th largest (ties at the boundary stay).
    Top-p keeps the smallest set of most likely tokens whose probability reaches p (the most likely
    token always stays), and the tokens tied with the least likely of them.
    """
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[1]
    if top_p is None:
        assert top_k is not None
        # Only top-k: the k-th largest value of each row via one topk over the batch's largest k.
        kth = logits.topk(max_top_k, dim=1).values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
        kth = kth.masked_fill((top_k >= V).unsqueeze(1), float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))

    if logits.device.type == "cpu":
        masked = _top_p_among_candidates(logits, top_k, top_p)
        if masked is not None:
            return masked
    return _top_k_top_p_by_sort(logits, top_k, top_p)


def _top_k_top_p_by_sort(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k then top-p through one sort of each row (no host sync, so the CUDA path). What is kept is
    every token at least as likely as the least likely one the cumulative mass keeps: a tie with it stays,
    whatever order the sort gave the tied tokens (bf16 logits tie often), as in `_top_p_among_candidates`."""
    V = logits.shape[1]
    asc = logits.sort(dim=-1).values.float()
    if top_k is not None:
        asc = asc.masked_fill(asc < asc.gather(1, (V - top_k).unsqueeze(1)), float("-inf"))
    cum = asc.softmax(dim=-1).cumsum(dim=-1)
    drop = (cum <= (1.0 - top_p).unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, -1] = False
    drop |= asc == float("-inf")
    # The kept tokens are the tail of the ascending order: the threshold is the first of them.
    threshold = asc.gather(1, (~drop).int().argmax(dim=1, keepdim=True))
    return logits.masked_fill(logits < threshold, float("-inf"))


# CPU top-p: the nucleus is first looked for among each row's largest logits (see `_top_p_among_candidates`).
TOP_P_CANDIDATES = 1024


def _top_p_among_candidates(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor | None:
    """Top-k and top-p from each row's `TOP_P_CANDIDATES` largest logits instead of a sort of the vocabulary,
    or None when some row's nucleus (or top-k set) may reach past them; the full sort then decides.

    On a CPU, sorting a 152k vocabulary takes ~10 ms a row (a sixth of the demo model's decode step on two
    cores); `topk` of 1024 under 1 ms. Top-p keeps the most likely tokens while the mass before them is
    below p (the most likely always stays), renormalized over the top-k set when there is one; a tie with
    the last kept logit stays too, as in top-k and in the sort path, which this matches up to the rounding
    of the cumulative sums at the boundary. Only for tensors on the host: deciding whether the candidates
    suffice reads their values, which on a GPU would stall the step on a device sync.
    """
    V = logits.shape[1]
    k0 = min(V, TOP_P_CANDIDATES)
    neg_inf = torch.tensor(float("-inf"))
    vals = logits.topk(k0, dim=1).values.float()  # descending
    norm = torch.logsumexp(logits.float(), dim=1, keepdim=True)
    floor = neg_inf.expand(logits.shape[0], 1)  # what rows without top-p keep: their top-k set, or all
    if top_k is not None:
        has_k = (top_k < V).unsqueeze(1)
        if bool((has_k.squeeze(1) & (top_k > k0)).any()):
            return None
        kth = vals.gather(1, (top_k.clamp(max=k0) - 1).unsqueeze(1))
        in_k = (vals >= kth) | ~has_k
        if k0 < V and bool((in_k[:, -1:] & has_k).any()):
            return None  # ties with the k-th logit may go on past the candidates
        vals = torch.where(in_k, vals, neg_inf)
        norm = torch.where(has_k, torch.logsumexp(vals, dim=1, keepdim=True), norm)
        floor = torch.where(has_k, kth, floor)
    probs = (vals - norm).exp()
    before = probs.cumsum(dim=1) - probs  # the mass of the more likely candidates
    keep = (before < top_p.unsqueeze(1)) & (vals > float("-inf"))
    keep[:, 0] = True
    no_p = (top_p >= 1.0).unsqueeze(1)
    if k0 < V and bool((keep[:, -1:] & ~no_p).any()):
        return None  # the nucleus may go on past the candidates
    inf = torch.tensor(float("inf"))
    threshold = torch.where(no_p, floor, torch.where(keep, vals, inf).amin(dim=1, keepdim=True))
    return logits.masked_fill(logits < threshold, float("-inf"))


class Sampler:
    """`Sampler(seed)(logits, meta) -> SamplerOutput`.

    `seed` seeds the generator that unseeded rows share (None: torch's default generator).
    The logits are [B, V] in any float dtype (converted to fp32 where anything reads or changes them
    beyond an argmax); fp32 logits may be modified in place.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        # One key per step for the fused CUDA race's unseeded rows, drawn on the host (no device sync).
        self._step_keys = random.Random(seed)
        self._generators: dict[torch.device, torch.Generator] = {}
        self._seeded_generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generators[device] = g
        return g

    def _seeded_generator(self, device: torch.device) -> torch.Generator:
        g = self._seeded_generators.get(device)
        if g is None:
            g = self._seeded_generators[device] = torch.Generator(device=device)
        return g

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dtype != torch.float32 and not self._reads_raw_logits(logits, meta):
            logits = logits.float()
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        if meta.grammar_bitmask is not None:
            apply_grammar_bitmask(logits, meta.grammar_bitmask, meta.grammar_rows)
        logits = self.process_logits(logits, meta)

        if meta.all_greedy:
            sampled = self._argmax(logits)
        else:
            drawn = self.sample_random(logits, meta)
            if meta.greedy_mask is not None:
                sampled = torch.where(meta.greedy_mask, self._argmax(logits), drawn)
            else:
                sampled = drawn

        lp = None
        if raw_logprobs is not None:
            lp = self.gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs or 0)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=lp)

    @staticmethod
    def _argmax(logits: torch.Tensor) -> torch.Tensor:
        """The greedy tokens: torch's argmax, or on a GPU `greedy_argmax` (the same tokens, in two small
        launches where torch's reduction took 9.3 us a step at batch 1)."""
        if not logits.is_cuda:
            return logits.argmax(dim=-1)
        from qwick.kernels.sampling import greedy_argmax

        return greedy_argmax(logits)

    @staticmethod
    def _reads_raw_logits(logits: torch.Tensor, meta: SamplingMetadata) -> bool:
        """True when nothing modifies the logits and the pick reads them as they are (bf16/fp16 convert to
        fp32 exactly, so the argmax is the same): all-greedy rows, or the fused CUDA race."""
        untouched = (
            meta.max_num_logprobs is None
            and meta.grammar_bitmask is None
            and meta.logit_bias is None
            and meta.min_tokens_mask is None
            and meta.no_penalties
        )
        fused = logits.is_cuda and meta.top_k is None and meta.top_p is None and meta.min_p is None
        return untouched and (meta.all_greedy or (fused and meta.greedy_mask is None))

    @staticmethod
    def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logit_bias, min_tokens, penalties: what greedy and random rows alike see."""
        if meta.logit_bias is not None:
            rows, toks, vals = meta.logit_bias
            logits = logits.index_put_((rows, toks), vals, accumulate=True)
        if meta.min_tokens_mask is not None:
            rows, toks = meta.min_tokens_mask
            logits = logits.index_put_(
                (rows, toks), torch.full(rows.shape, float("-inf"), device=logits.device)
            )
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta)
        return logits

    def sample_random(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, exponential race. Greedy rows' results are discarded."""
        if logits.is_cuda and meta.top_k is None and meta.top_p is None and meta.min_p is None:
            return self._race_fused(logits, meta)
        if meta.temperature is not None:
            logits = logits / meta.temperature.unsqueeze(1)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.max_top_k, meta.top_p)
        probs = logits.softmax(dim=-1)
        if meta.min_p is not None:
            threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        q = self._noise(probs.shape, probs.device, meta)
        # argmax(p / q) with q ~ Exp(1) picks token i with probability p_i / sum(p) (scale-free).
        return probs.div_(q).argmax(dim=-1)

    def _race_fused(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Temperature and the exponential race in one pass over the logits (CUDA, no truncation): neither
        the softmax nor the noise is materialized, where the torch path makes ~8 passes. Seeded rows draw
        the noise `seeded_uniform_` would give them; unseeded rows are keyed by this step's key + row."""
        from qwick.kernels.sampling import race_sample

        base = (1 << 32) + self._step_keys.getrandbits(61)
        row_seeds = None
        if meta.seeded_rows:
            row_seeds = [base + i for i in range(meta.num_rows)]
            for row, s in zip(meta.seeded_rows, meta.seeded_generator_seeds):
                row_seeds[row] = s
        return race_sample(logits, meta.temperature, base, row_seeds)

    @staticmethod
    def warm_up(vocab_size: int, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        """Compile the sampling kernels now rather than on the first request that needs one (CUDA only):
        the seeded noise, the greedy argmax, and the fused race with and without temperatures and per-row
        seeds, on logits as the model writes them (`dtype`) and in fp32 (after penalties or a logit bias)."""
        if device.type == "cuda":
            from qwick.kernels.sampling import greedy_argmax, race_sample, seeded_uniform_

            seeded_uniform_(torch.zeros((1, vocab_size), dtype=torch.float32, device=device), [0], [0])
            temperature = torch.ones(1, dtype=torch.float32, device=device)
            for logits_dtype in {dtype, torch.float32}:
                logits = torch.zeros((1, vocab_size), dtype=logits_dtype, device=device)
                greedy_argmax(logits)
                for temp in (None, temperature):
                    for seeds in (None, [1 << 40]):
                        race_sample(logits, temp, 1 << 40, seeds)

    def _noise(self, shape: torch.Size, device: torch.device, meta: SamplingMetadata) -> torch.Tensor:
        """Exp(1) noise as -log(U): on the CPU `rand` + `log` is 6x faster than `exponential_`
        (7.5 vs 44 ms for 16 x 152k draws on 2 cores), and it is as cheap on GPUs."""
        q = torch.empty(shape, dtype=torch.float32, device=device)
        if len(meta.seeded_rows) < shape[0]:
            q.uniform_(generator=self._generator(device))
        if meta.seeded_rows and q.is_cuda:
            from qwick.kernels.sampling import seeded_uniform_

            seeded_uniform_(q, meta.seeded_rows, meta.seeded_generator_seeds)
        elif meta.seeded_rows:
            g = self._seeded_generator(device)
            for row, s in zip(meta.seeded_rows, meta.seeded_generator_seeds):
                g.manual_seed(s)
                q[row].uniform_(generator=g)
        q.log_().neg_()
        # U = 0 gives inf (harmless: that token scores 0); keep 0 / 0 (a masked token) from being NaN.
        return q.clamp_(min=1e-30)

    @staticmethod
    def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
        sampled = sampled.unsqueeze(1)
        sampled_lp = raw_logprobs.gather(1, sampled)
        ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
        if k > 0:
            top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
            ids = torch.cat([sampled, top_ids], dim=1)
            lps = torch.cat([sampled_lp, top_lp], dim=1)
        else:
            ids, lps = sampled, sampled_lp
        return LogprobsTensors(logprob_token_ids=ids, logprobs=lps, selected_token_ranks=ranks)
