"""Token-by-token generation for requests that mix adapters (``lorahook serve``).

A :class:`Batch` runs one transformers causal LM on several requests at once,
each row with its own adapter through ``attached.sequences(names)``.
Requests are *admitted* (:meth:`Batch.admit`), prefilled together at the
next :meth:`Batch.step` (left-padded prompts), then decoded one token per
step.  Each request has its own sampling (greedy at ``temperature`` below
``1e-5``, else temperature and ``top_p`` with its own seeded generator), its
own ``max_tokens`` and ``stop`` strings.

A request's failure is its own: a row whose logits (or, sampled, whose
probabilities) are not finite, or whose sampling or decoding raises, ends
with finish reason ``"error"`` and the error's message, and leaves the batch;
the other rows go on as they would alone.  Text is decoded incrementally (a
window of the last tokens per step) and stop strings are searched in the new
text plus the longest stop's length, so a step costs the same however much
text came before.

The rows' adapters are bound once per change of the rows (an admission, a
row leaving), not once per step: every decode step in between reuses that
selection and the plans its projections made on their first call.

With a joinable cache (:func:`joinable`: transformers' ``DynamicCache`` of
full-attention layers), requests may be admitted while others are decoding:
their keys and values are left-padded to the batch's length and appended
along the batch; a finished or abandoned request's row is dropped at once,
and columns no row needs any more are cut from the left.  Other caches
(sliding windows, linear attention) keep the rows they started with, and a
finished row decodes on unreported until the batch ends.

Pure torch and transformers: no Ray, no HTTP.
"""
import inspect

import torch

__all__ = ["Request", "Batch", "joinable", "cache_of", "model_context"]


class Request:
    """One request's prompt tokens and sampling settings (checked by the server)."""

    __slots__ = ("prompt_ids", "max_tokens", "temperature", "top_p", "seed", "stop")

    def __init__(self, prompt_ids, max_tokens=16, temperature=1.0, top_p=1.0, seed=None,
                 stop=()):
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = int(max_tokens)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.seed = seed
        self.stop = tuple(stop)


# below this temperature a row is greedy (what vLLM does): dividing by it would overflow
GREEDY_BELOW = 1e-5


def _held_back(text, stops):
    """How many trailing characters could still grow into a stop string."""
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held


def model_context(config):
    """The context length of a transformers config (``max_position_embeddings``), or ``None``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def cache_of(output):
    """A forward's cache: ``output.cache`` (transformers 5.x renamed ``past_key_values``)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _cache_argument(model):
    """The name under which ``model``'s forward takes the cache."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def joinable(cache):
    """Whether rows can be added to and dropped from ``cache`` (a forward's :func:`cache_of`)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer
    return (type(cache) is DynamicCache and bool(cache.layers)
            and all(type(layer) is DynamicLayer and layer.is_initialized
                    for layer in cache.layers))


class _Live:
    """One admitted request: its adapter, what it generated and sent, and how it ended."""

    __slots__ = ("name", "request", "index", "generated", "text", "sent", "reason", "error",
                 "rng", "prefix", "read")

    def __init__(self, name, request, index):
        self.name, self.request, self.index = name, request, index
        self.generated = []
        self.text = ""      # the decoded text so far
        self.sent = 0       # how much of it was reported
        self.prefix = self.read = 0  # the window of tokens the next decode starts from
        self.reason = None  # the finish reason, once finished (reported then; DONE a step later)
        self.error = None   # with reason "error": what went wrong, for the request's answer
        self.rng = None
        if request.seed is not None:
            self.rng = torch.Generator()
            self.rng.manual_seed(int(request.seed) % (1 << 64))


class Batch:
    """Requests generated together; :meth:`step` until :attr:`done`."""

    def __init__(self, model, tokenizer, attached, pad_token_id, eos_ids, can_join=None):
        self.model, self.tokenizer, self.attached = model, tokenizer, attached
        self.pad = pad_token_id
        self.eos = frozenset(eos_ids)
        self.can_join = can_join  # None: decided by the first prefill's cache
        self._cache_arg = _cache_argument(model)
        self.open = []       # admitted requests not yet reported done, in admission order
        self.rows = []       # the request of each row of the tensors below
        self.waiting = []    # admitted, to prefill at the next step
        self.cache = self.input_ids = self.mask = self.positions = None
        self.reported = []   # the open requests as the last step reported them, in order
        self._count = 0
        self._selection = None  # (rows' names, the bound selection) reused while rows stay

    @property
    def done(self):
        return not self.open

    def admit(self, names, requests):
        """Add requests (prefilled at the next step); returns their :class:`_Live` records."""
        if self.rows and not self.can_join:
            raise RuntimeError("this model's cache cannot take rows while others decode")
        lives = []
        for name, request in zip(names, requests, strict=True):
            lives.append(_Live(name, request, self._count))
            self._count += 1
        self.open += lives
        self.waiting += lives
        return lives

    def retire(self, positions):
        """Drop the requests at ``positions`` of the last step's reports (their callers left)."""
        gone = {id(self.reported[p]) for p in positions}
        if not gone:
            return
        for live in self.open:
            if id(live) in gone and live.reason is None:
                live.reason = "abandoned"
        self.open = [live for live in self.open if id(live) not in gone]
        self.waiting = [live for live in self.waiting if id(live) not in gone]
        self._drop_finished()

    # --- one step -----------------------------------------------------------

    def step(self):
        """Decode the running rows and prefill the waiting requests: one report per open request.

        A report is ``(text, finish_reason)``: the text the request gained and,
        on its last report, why it finished (``"error"``: see the request's
        :attr:`_Live.error`); ``None`` once that was reported (the request
        then leaves :attr:`open`).  :attr:`reported` lists the
        requests reported on, in order.
        """
        done = {id(live) for live in self.open if live.reason is not None}  # reported last step
        reports = {}
        with torch.inference_mode():
            if self.rows:
                self._decode(reports)
            if self.waiting:
                self._prefill(reports)
        self.reported = list(self.open)
        out = [None if id(live) in done else reports[id(live)] for live in self.reported]
        self.open = [live for live, report in zip(self.reported, out) if report is not None]
        self._drop_finished()
        return out

    def _forward(self, names, **inputs):
        names = tuple(names)
        if self._selection is None or self._selection[0] != names:
            self._selection = (names, self.attached.sequences(names))
        with self._selection[1]:
            return self.model(use_cache=True, **inputs)

    def _decode(self, reports):
        out = self._forward([live.name for live in self.rows], input_ids=self.input_ids,
                            attention_mask=self.mask, position_ids=self.positions,
                            **{self._cache_arg: self.cache})
        self.cache = cache_of(out)
        tokens = self._next_tokens(self.rows, out.logits[:, -1, :].float())
        self.input_ids = self._inputs(tokens)
        self.positions = self.positions + 1
        self.mask = torch.cat([self.mask, torch.ones((len(tokens), 1), dtype=torch.long)], dim=1)
        for live, token in zip(self.rows, tokens):
            if live.reason is None:
                reports[id(live)] = self._report(live, token)

    def _prefill(self, reports):
        lives, self.waiting = self.waiting, []
        width = max(len(live.request.prompt_ids) for live in lives)
        ids = torch.tensor([[self.pad] * (width - len(live.request.prompt_ids))
                            + live.request.prompt_ids for live in lives], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(live.request.prompt_ids))
                             + [1] * len(live.request.prompt_ids) for live in lives],
                            dtype=torch.long)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self._forward([live.name for live in lives], input_ids=ids, attention_mask=mask,
                            position_ids=positions)
        if self.can_join is None:
            self.can_join = joinable(cache_of(out))
        tokens = self._next_tokens(lives, out.logits[:, -1, :].float())
        new = (cache_of(out), self._inputs(tokens),
               torch.cat([mask, torch.ones((len(lives), 1), dtype=torch.long)], dim=1),
               positions[:, -1:] + 1)
        if self.rows:
            self._merge(lives, *new)
        else:
            self.rows = lives
            self.cache, self.input_ids, self.mask, self.positions = new
        for live, token in zip(lives, tokens):
            reports[id(live)] = self._report(live, token)

    def _inputs(self, tokens):
        """The next step's input ids (a failed row, which leaves, is given the pad token)."""
        return torch.tensor([self.pad if t is None else t for t in tokens],
                            dtype=torch.long)[:, None]

    # --- rows ---------------------------------------------------------------

    def _merge(self, lives, cache, input_ids, mask, positions):
        """Append prefilled rows to the running ones, left-padding the shorter side."""
        length = max(self.mask.shape[1], mask.shape[1])

        def left_pad(t, width, dim):
            if t.shape[dim] == width:
                return t
            shape = list(t.shape)
            shape[dim] = width - t.shape[dim]
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        # the mask covers the cache and the next input token: the cache is one shorter
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            for attr in ("keys", "values"):
                joined = [left_pad(getattr(layer, attr), length - 1, -2) for layer in (mine, theirs)]
                setattr(mine, attr, torch.cat(joined, dim=0))
        self.mask = torch.cat([left_pad(self.mask, length, 1), left_pad(mask, length, 1)])
        self.input_ids = torch.cat([self.input_ids, input_ids])
        self.positions = torch.cat([self.positions, positions])
        self.rows = self.rows + lives

    def _drop_finished(self):
        """Drop the rows of finished requests, and the leading columns no row needs."""
        if not self.can_join or not self.rows:
            return
        keep = [i for i, live in enumerate(self.rows) if live.reason is None]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.input_ids = self.mask = self.positions = None
            return
        index = torch.tensor(keep, dtype=torch.long)
        self.mask = self.mask[index]
        self.input_ids = self.input_ids[index]
        self.positions = self.positions[index]
        cut = int((self.mask.sum(dim=0) == 0).long().cumprod(dim=0).sum())  # empty leading columns
        self.mask = self.mask[:, cut:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, cut:]
            layer.values = layer.values[index, :, cut:]

    # --- tokens -------------------------------------------------------------

    def _next_tokens(self, lives, logits):
        """One token per row; a row that cannot have one fails (its token is then ``None``)."""
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        out = logits.argmax(dim=-1).tolist()  # greedy rows keep these
        for i, live in enumerate(lives):
            if live.reason is not None:
                continue
            if not finite[i]:
                self._fail(live, "the model's logits for this request are not finite")
                out[i] = None
                continue
            r = live.request
            if r.temperature < GREEDY_BELOW:
                continue
            try:
                out[i] = self._sample(logits[i], r, live.rng)
            except Exception as exc:
                self._fail(live, f"sampling failed: {exc}")
                out[i] = None
        return out

    @staticmethod
    def _sample(logits, r, rng):
        probs = torch.softmax(logits.double() / r.temperature, dim=-1)
        if r.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < r.top_p  # the smallest set reaching top_p
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
            raise ValueError("the probabilities are not finite")
        return int(torch.multinomial(probs, 1, generator=rng))

    @staticmethod
    def _fail(live, message):
        live.reason, live.error = "error", message

    def _report(self, live, token):
        if token is None:  # failed in _next_tokens
            return "", live.reason
        try:
            return self._advance(live, token)
        except Exception as exc:
            self._fail(live, f"decoding failed: {exc}")
            return "", live.reason

    def _advance(self, live, token):
        r = live.request
        reason = None
        if token in self.eos:
            reason = "stop"
        else:
            live.generated.append(token)
            # the new text: what the window decodes to past what it decoded to before
            # (nothing while it ends in a partial character)
            before = self.tokenizer.decode(live.generated[live.prefix:live.read],
                                           skip_special_tokens=True)
            after = self.tokenizer.decode(live.generated[live.prefix:],
                                          skip_special_tokens=True)
            if len(after) > len(before) and not after.endswith("\ufffd"):
                start = max(0, len(live.text) - max((len(s) for s in r.stop), default=1) + 1)
                live.text += after[len(before):]
                live.prefix, live.read = live.read, len(live.generated)
                for stop in r.stop:
                    at = live.text.find(stop, start)
                    if at >= 0:
                        live.text, reason = live.text[:at], "stop"
        if reason is None and len(live.generated) >= r.max_tokens:
            reason = "length"
        text = live.text
        upto = len(text) if reason is not None else len(text) - _held_back(text, r.stop)
        delta = text[live.sent:upto] if upto > live.sent else ""
        live.sent += len(delta)
        live.reason = reason
        return delta, reason
