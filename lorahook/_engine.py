"""Token-by-token generation for a batch of requests that mix adapters (``lorahook serve``).

A :class:`Batch` runs one transformers causal LM on several requests at once:
one prefill of the left-padded prompts, then one decode step per token, each
step inside ``attached.sequences(names)`` so that every row gets its own
adapter.  Each request has its own sampling (greedy at ``temperature`` 0,
else temperature and ``top_p`` with its own seeded generator), its own
``max_tokens`` and ``stop`` strings; :meth:`Batch.step` returns, per request,
the text that request gained this step and, once, why it finished.  A
finished request's row keeps decoding (the batch shape stays fixed) but
nothing more is reported for it.  Pure torch and transformers: no Ray, no
HTTP.
"""
import torch

__all__ = ["Request", "Batch"]


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


def _held_back(text, stops):
    """How many trailing characters could still grow into a stop string (or a whole character)."""
    held = 1 if text.endswith("\ufffd") else 0  # a UTF-8 character split across tokens
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held


class Batch:
    """Requests generated together; :meth:`step` until every one is finished."""

    def __init__(self, model, tokenizer, attached, names, requests, pad_token_id, eos_ids):
        self.model, self.tokenizer, self.attached = model, tokenizer, attached
        self.names = list(names)
        self.requests = list(requests)
        self.eos = frozenset(eos_ids)
        n = len(self.requests)
        width = max(len(r.prompt_ids) for r in self.requests)
        self.input_ids = torch.tensor([[pad_token_id] * (width - len(r.prompt_ids)) + r.prompt_ids
                                       for r in self.requests], dtype=torch.long)
        self.mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids)
                                  for r in self.requests], dtype=torch.long)
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = None
        self.generated = [[] for _ in range(n)]
        self.sent = [""] * n
        self.finished = [None] * n  # the finish reason, once finished
        self.rngs = []
        for r in self.requests:
            if r.seed is None:
                self.rngs.append(None)
            else:
                g = torch.Generator()
                g.manual_seed(int(r.seed))
                self.rngs.append(g)

    @property
    def done(self):
        return all(reason is not None for reason in self.finished)

    def _next_tokens(self, logits):
        out = logits.argmax(dim=-1).tolist()  # greedy rows (temperature 0) keep these
        for i, r in enumerate(self.requests):
            if r.temperature == 0.0:
                continue
            probs = torch.softmax(logits[i] / r.temperature, dim=-1)
            if r.top_p < 1.0:
                sorted_p, order = torch.sort(probs, descending=True)
                keep = sorted_p.cumsum(-1) - sorted_p < r.top_p  # the smallest set reaching top_p
                sorted_p = sorted_p * keep
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
            out[i] = int(torch.multinomial(probs, 1, generator=self.rngs[i]))
        return out

    def step(self):
        """One forward; returns per request ``(text, finish_reason)`` or ``None`` once reported."""
        with torch.inference_mode(), self.attached.sequences(self.names):
            if self.cache is None:
                out = self.model(input_ids=self.input_ids, attention_mask=self.mask,
                                 position_ids=self.positions, use_cache=True)
            else:
                out = self.model(input_ids=self.input_ids, attention_mask=self.mask,
                                 position_ids=self.positions, past_key_values=self.cache,
                                 use_cache=True)
        self.cache = out.past_key_values
        tokens = self._next_tokens(out.logits[:, -1, :].float())
        self.input_ids = torch.tensor(tokens, dtype=torch.long)[:, None]
        self.positions = self.positions[:, -1:] + 1
        self.mask = torch.cat([self.mask, torch.ones((len(tokens), 1), dtype=torch.long)], dim=1)
        return [self._report(i, token) for i, token in enumerate(tokens)]

    def _report(self, i, token):
        if self.finished[i] is not None:
            return None
        r = self.requests[i]
        reason = None
        if token in self.eos:
            reason = "stop"
        else:
            self.generated[i].append(token)
        text = self.tokenizer.decode(self.generated[i], skip_special_tokens=True)
        for stop in r.stop:
            at = text.find(stop)
            if at >= 0:
                text, reason = text[:at], "stop"
        if reason is None and len(self.generated[i]) >= r.max_tokens:
            reason = "length"
        upto = len(text) if reason is not None else len(text) - _held_back(text, r.stop)
        delta = text[len(self.sent[i]):upto] if upto > len(self.sent[i]) else ""
        self.sent[i] += delta
        self.finished[i] = reason
        return delta, reason

    def completion_tokens(self, i):
        return len(self.generated[i])
