# cython: language_level=3
# Kernel sources (see _sources.pyx): what lorahook._rows runs a hook's
# layers through.
cimport numpy as cnp

# How apply_lora_rows treats a kernel table (KernelSource._dispatch).
cdef enum:
    _KERNELS = 0
    _ASK_HOOK = 1
    _PER_ROW = 2


cdef class KernelSource:
    cdef int _dispatch        # one of the DISPATCH_* values
    cdef bint _filled         # set once: a source never changes afterwards

    cdef int _fill_once(self) except -1
    cdef Py_ssize_t _rows_per_unit(self, Py_ssize_t n) except -1
    cdef int _check_widths(self, tuple key, Py_ssize_t d_in, Py_ssize_t d_out) except -1
    cdef int _run(self, tuple key, cnp.ndarray x, cnp.ndarray y, Py_ssize_t n,
                  Py_ssize_t per_unit, Py_ssize_t d_in, Py_ssize_t d_out, int kind) except -1
    cdef int _run_ids(self, tuple key, cnp.ndarray ids, cnp.ndarray y, Py_ssize_t n,
                      Py_ssize_t per_unit, Py_ssize_t d_out, int kind) except -1


cdef class KernelTable(KernelSource):
    cdef dict _table          # key -> LayerKernel, for every row


cdef class UnitGroups(KernelSource):
    cdef tuple _parts         # ((label, KernelTable, {scale: (s, units, scales)}), ...)
    cdef Py_ssize_t _units    # a call has a multiple of _units rows ...
    cdef bint _exact          # ... or exactly _units rows
    cdef dict _resolved       # key -> tuple of (label, kernel, s, units, scales)
    cdef dict _plans          # rows per unit -> {key: GroupPlan}

    cdef tuple _groups(self, tuple key)
