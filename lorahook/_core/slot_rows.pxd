# cython: language_level=3
# Rows grouped by adapter slot, and the checks of rows and stacked factors
# (see slot_rows.pyx); shared with lorahook._core.slot_pairs.

cdef class SlotRows:
    cdef readonly Py_ssize_t n_rows
    cdef readonly Py_ssize_t n_slots
    cdef readonly Py_ssize_t n_covered   # rows that have a slot
    cdef readonly Py_ssize_t max_slot    # the highest slot with rows, -1 when none
    cdef object _order_obj
    cdef object _starts_obj
    cdef const int *_order               # rows by slot: slot s holds order[starts[s]:starts[s+1]]
    cdef const Py_ssize_t *_starts


cdef int half_bits(object half) except -2
cdef int rows_kind(object arr, str name, int bits, bint writable, Py_ssize_t n,
                   Py_ssize_t *width, Py_ssize_t *ld) except -1
cdef int weights_kind(object arr, str name, int bits) except -1
