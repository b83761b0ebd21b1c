"""lorahook inside vLLM on CPUs: the punica wrapper that runs vLLM's multi-LoRA on lorahook's kernels.

Installing ``lorahook[vllm]`` beside a CPU build of vLLM registers a vLLM
general plugin (entry-point group ``vllm.general_plugins``, name
``lorahook``), which vLLM loads in every process it starts.  On a CPU
platform the plugin makes ``current_platform.get_punica_wrapper()`` name
:class:`PunicaWrapperLorahook`, so an unchanged ``vllm serve MODEL
--enable-lora ...`` or ``vllm.LLM(..., enable_lora=True)`` applies its
adapters with lorahook.  ``VLLM_PLUGINS`` (vLLM's own allowlist) turns it off:
``VLLM_PLUGINS=none`` runs vLLM's own kernels.

What the wrapper does differently from vLLM's CPU wrapper, whose methods it
overrides one for one: vLLM's CPU ops copy every token's ``A`` and ``B`` out
of the stacked slot weights before an ``einsum``.  This wrapper groups the
step's rows by slot once, in :meth:`~PunicaWrapperLorahook.update_metadata`
(:class:`lorahook._core.slot_rows.SlotRows`), and every linear projection (and the
logits) then runs :func:`lorahook._core.slot_pairs.apply_pairs` on vLLM's own
tensors, with the GIL released -- a projection's rows read where they lie
(:func:`~lorahook._core.slot_pairs.apply_pairs_tensors`: no NumPy view is made, which
on a decode step's few rows cost more than the kernel):

* **in the model's dtype**: ``A`` is read in place; ``B`` transposed (an
  adapter's own ``B`` laid out so once, in place; vLLM's stacked ``B`` copied);
  16-bit rows are read and written as they are, widened in
  registers, products summed in float32 (or as the CPU's bfloat16 dot
  products), each output rounded once;
* **at each slot's own rank**: the linear layers and the logits hold no
  stacked slots; a slot refers to its adapter's own tensors in vLLM's CPU
  cache (:mod:`lorahook.vllm.slots`), so a slot costs what its adapter
  holds whatever ``--max-loras`` and ``--max-lora-rank`` say.  vLLM's own
  stacked slots (every linear layer's with ``LORAHOOK_VLLM_SLOTS=stacked``)
  are read at each slot's real rank, found
  when vLLM writes the slot (the tensors' version counters say so), never
  per step;
* **on vLLM's threads**: the work is split over a team of
  ``torch.get_num_threads()`` threads of the OpenMP runtime torch computes on
  (vLLM preloads it and binds its threads to the cores), so no second pool
  competes with torch's; ``LORAHOOK_VLLM_THREADS`` sets another count.

**Compiled.**  vLLM's CPU platform turns torch.compile off whenever LoRA is
enabled; with the plugin active, vLLM's compilation mode is kept
(``LORAHOOK_VLLM_COMPILE=0`` gives vLLM its own choice back).  Inside a
graph Dynamo traces, each wrapper call is one torch custom op,
``torch.ops.lorahook.punica`` (``y`` written in place, a fake implementation
for tracing), opaque to the compiler: the step's grouping is read from the
wrapper when the op runs, never baked into the graph, so one graph serves
every step and every row count.  ``apply_lora_full_linear`` (classifier
heads, which pick their rows in Python, outside the compiled model) stays
vLLM's own op if a graph ever traces it.

The few calls that kernel does not take (a shrink or expand on its own,
embeddings, classifier heads, mixed dtypes) run
:func:`lorahook._core.slot_rows.apply_slots`.  Rows without an adapter are never
written.  Anything else (a tensor on another device, a dtype lorahook does not
serve) goes to vLLM's own op for that call.  ``LORAHOOK_VLLM_PROFILE=FILE``
makes each worker write where its LoRA time goes (per projection kind, and the
per-step metadata) to ``FILE`` as JSON.

This package is laid out as vLLM lays out its ``punica_wrapper``: the
plugin's registration (:mod:`~lorahook.vllm.plugin`), the wrapper
(:mod:`~lorahook.vllm.punica_lorahook`), the layers' slot tables
(:mod:`~lorahook.vllm.slots`), vLLM's stacked slots
(:mod:`~lorahook.vllm.stacked`), tensor views
(:mod:`~lorahook.vllm.tensors`), the custom op
(:mod:`~lorahook.vllm.custom_op`) and the profile
(:mod:`~lorahook.vllm.profile`).  It is the one part of lorahook that imports
vLLM; ``import lorahook`` never does.
"""
from lorahook.vllm.plugin import register
from lorahook.vllm.punica_lorahook import QUALNAME, PunicaWrapperLorahook

__all__ = ["PunicaWrapperLorahook", "register", "QUALNAME"]
