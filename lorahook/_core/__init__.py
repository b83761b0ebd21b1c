"""The compiled core behind :func:`lorahook.apply_lora_rows` (``lorahook/_rows.pyx``).

Its modules know kernels and buffers, never adapters, file formats or names;
``lorahook/_rows.pyx`` says which module holds what.
"""
