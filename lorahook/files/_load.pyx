# cython: language_level=3
"""Reading tensors from a file descriptor: the loaders' one copy per value.

Beside the core, for ``lorahook.files``: :func:`read_plan` reads a plan of
byte offsets from a file descriptor into a float32 buffer, widening float16
and bfloat16 values, transposing ``B`` into the kernels' layout and counting
non-finite values, all without the GIL; :func:`aligned_floats` makes the
64-byte aligned buffer it fills.  The file formats themselves (headers,
names, configs) are Python's business, in ``lorahook.files``.
"""
cimport numpy as cnp
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.errno cimport EINTR, errno
from libc.stdint cimport INT64_MAX, uint16_t, uintptr_t
from libc.stdlib cimport free, malloc
from posix.stdlib cimport posix_memalign
from posix.uio cimport iovec, preadv

from lorahook._core.halfconv cimport LORAHOOK_HALF_BF16, LORAHOOK_HALF_F16, isa_cell, lh_isa_attach
from lorahook._core.halfconv cimport widen_n

cnp.import_array()
lh_isa_attach(isa_cell())  # the process's instruction-set target (isa.h)

cdef extern from "halfconv.h":
    pass

cdef extern from "_load.h" nogil:
    size_t lorahook_count_nonfinite(const float *x, size_t n) noexcept
    void lorahook_transpose(const float *src, size_t rows, size_t cols, float *dst, size_t ld) noexcept
    void lorahook_advise_hugepages(void *p, size_t n) noexcept

# Columns of a read plan, one row per tensor (see _read_plan).
cdef enum:
    _P_OFFSET = 0
    _P_COUNT = 1
    _P_START = 2
    _P_ROWS = 3
    _P_COLS = 4
    _P_KIND = 5
    _P_FLIP = 6
    _P_WIDTH = 7
    _MAX_IOV = 1024

ctypedef struct _Piece:
    Py_ssize_t t        # tensor (plan row)
    Py_ssize_t u0       # first unit (element, or file row when transposed)
    Py_ssize_t take     # units in this piece
    Py_ssize_t boff     # byte offset in the bounce buffer, -1: read in place


cdef void _finish_piece(const cnp.int64_t *row, float *buffer, const char *bounce,
                        float *conv, const _Piece *p, cnp.int64_t *bad) noexcept nogil:
    """Convert one piece (plan row ``row``) into place, counting non-finite values."""
    cdef int kind = <int>row[_P_KIND]
    cdef size_t rows = <size_t>row[_P_ROWS]
    cdef size_t cols = <size_t>row[_P_COLS]
    cdef float *dst = buffer + row[_P_START]
    cdef size_t n
    cdef const float *src
    cdef int hk = LORAHOOK_HALF_F16 if kind == 1 else LORAHOOK_HALF_BF16
    if p.boff < 0:  # float32 read in place
        bad[0] += <cnp.int64_t>lorahook_count_nonfinite(dst + p.u0, <size_t>p.take)
        return
    if row[_P_FLIP] == 0:  # a half tensor, widened into place
        widen_n(<const uint16_t *>(bounce + p.boff), dst + p.u0, <size_t>p.take, hk)
        bad[0] += <cnp.int64_t>lorahook_count_nonfinite(dst + p.u0, <size_t>p.take)
        return
    n = <size_t>p.take * cols
    if kind == 0:
        src = <const float *>(bounce + p.boff)
    else:
        widen_n(<const uint16_t *>(bounce + p.boff), conv, n, hk)
        src = conv
    bad[0] += <cnp.int64_t>lorahook_count_nonfinite(src, n)
    lorahook_transpose(src, <size_t>p.take, cols, dst + p.u0, rows)


cdef extern from "Python.h":
    int PyTraceMalloc_Track(unsigned int domain, uintptr_t ptr, size_t size)
    int PyTraceMalloc_Untrack(unsigned int domain, uintptr_t ptr)


# numpy's own tracemalloc domain (``numpy.lib.tracemalloc_domain``): the
# blocks are counted with numpy's arrays by tracemalloc.
cdef unsigned int _NUMPY_TRACE_DOMAIN = 389047


cdef class _AlignedBlock:
    """The memory of one :func:`aligned_floats` array, freed with the last view of it."""
    cdef void *ptr

    def __dealloc__(self):
        if self.ptr != NULL:
            PyTraceMalloc_Untrack(_NUMPY_TRACE_DOMAIN, <uintptr_t>self.ptr)
            free(self.ptr)
            self.ptr = NULL

    def __reduce__(self):
        raise TypeError("an aligned block is not pickled (its arrays are)")


def aligned_floats(Py_ssize_t n, bint hugepages):
    """A new, uninitialised float32 array of ``n`` values starting on a 64-byte boundary.

    What :func:`read_plan` fills: transposed tensors are written a whole cache
    line at a time, past the cache, only when their lines are aligned.  With
    ``hugepages`` the whole pages of a large block are advised as huge pages,
    as numpy does for its own large arrays.  The array's bytes are exactly
    ``4 * n``; the block is traced by ``tracemalloc`` in numpy's domain.
    """
    cdef void *ptr = NULL
    cdef size_t size
    cdef cnp.npy_intp dims[1]
    if n < 0 or n > PY_SSIZE_T_MAX // <Py_ssize_t>sizeof(float):
        raise ValueError(f"n must be in 0..{PY_SSIZE_T_MAX // <Py_ssize_t>sizeof(float)}, got {n}")
    size = <size_t>(n if n > 0 else 1) * sizeof(float)
    if posix_memalign(&ptr, 64, size) != 0:
        raise MemoryError(f"cannot allocate {size} bytes")
    block = _AlignedBlock()
    block.ptr = ptr
    PyTraceMalloc_Track(_NUMPY_TRACE_DOMAIN, <uintptr_t>ptr, size)
    if hugepages and size >= (<size_t>1 << 22):
        lorahook_advise_hugepages(ptr, size)
    dims[0] = n
    arr = cnp.PyArray_SimpleNewFromData(1, dims, cnp.NPY_FLOAT32, ptr)
    cnp.set_array_base(arr, block)
    return arr


def read_plan(int fd, const cnp.int64_t[:, ::1] plan not None, float[::1] buffer not None,
               cnp.int64_t[::1] bad not None, Py_ssize_t bounce_bytes, Py_ssize_t run_bytes,
               int max_run):
    """Read tensors from ``fd`` into ``buffer``, one copy per value, without the GIL.

    ``plan`` has one row per tensor, in file order: ``(file offset, count,
    start, rows, cols, kind, flip)``.  The tensor's ``count`` values of kind 0
    (float32), 1 (float16) or 2 (bfloat16), little-endian, start at byte
    ``file offset``; they become float32 values at ``buffer[start : start +
    count]``, widened exactly (as ``lorahook._core.halfconv.widen``) and, with ``flip``, as
    the ``(cols, rows)`` transpose of the file's ``(rows, cols)`` layout.
    ``bad[t]`` receives the number of NaNs and infinities of tensor ``t``.

    Runs of tensors that follow each other in the file are read with one
    ``preadv`` each, at most ``max_run`` pieces and about ``run_bytes`` bytes,
    so that each run is checked and converted while it is in cache.  Float32
    values read in place go straight from the file into ``buffer``; the others
    pass through a bounce buffer of ``bounce_bytes`` (grown to one file row if
    a row is larger).  The plan is checked against ``buffer`` first: nothing is
    written outside it.

    Returns ``(0, 0)`` when every byte was read, ``(1, t)`` when the file ended
    inside tensor ``t``, ``(2, errno)`` when a read failed.
    """
    cdef Py_ssize_t n = plan.shape[0], size = buffer.shape[0], t
    cdef cnp.int64_t count, rows, cols, start
    if plan.shape[1] != _P_WIDTH:
        raise ValueError(f"plan must have {_P_WIDTH} columns, found {plan.shape[1]}")
    if bad.shape[0] != n:
        raise ValueError(f"bad must have one entry per tensor ({n}), found {bad.shape[0]}")
    if not 1 <= max_run <= _MAX_IOV or bounce_bytes < 64 or run_bytes < 1:
        raise ValueError(f"limits out of range: max_run={max_run} (1..{_MAX_IOV}), "
                         f"bounce_bytes={bounce_bytes} (>= 64), run_bytes={run_bytes} (>= 1)")
    for t in range(n):
        count, start = plan[t, _P_COUNT], plan[t, _P_START]
        rows, cols = plan[t, _P_ROWS], plan[t, _P_COLS]
        if (plan[t, _P_OFFSET] < 0 or count < 0 or rows < 0 or cols < 0
                or not 0 <= plan[t, _P_KIND] <= 2 or not 0 <= plan[t, _P_FLIP] <= 1
                or (count != 0 if cols == 0 else (rows != count // cols or count % cols))
                or start < 0 or start > size or count > size - start
                # count <= size < 2**61: the byte count cannot overflow, the end offset could
                or plan[t, _P_OFFSET] > INT64_MAX - count * (4 if plan[t, _P_KIND] == 0 else 2)):
            raise ValueError(f"plan row {t} is not a tensor inside a buffer of {size} values: "
                             f"{list(plan[t])}")
        bad[t] = 0
    cdef float *out = &buffer[0] if size else NULL
    cdef cnp.int64_t *nbad = &bad[0] if n else NULL
    cdef const cnp.int64_t *P = &plan[0, 0] if n else NULL
    cdef const cnp.int64_t *row
    cdef size_t cap = <size_t>bounce_bytes
    cdef char *bounce = <char *>malloc(cap)
    cdef float *conv = NULL
    cdef iovec *iov = <iovec *>malloc(<size_t>max_run * sizeof(iovec))
    cdef _Piece *pieces = <_Piece *>malloc(<size_t>max_run * sizeof(_Piece))
    cdef int status = 0, np_, i
    cdef Py_ssize_t detail = 0, u = 0, units, unit_bytes, take, used, boff, room
    cdef long long pos, run_start = 0, run_end = 0, got
    cdef bint direct
    cdef char *grown
    if bounce == NULL or iov == NULL or pieces == NULL:
        free(bounce); free(iov); free(pieces)
        raise MemoryError("no memory for the read's buffers")
    t = 0
    with nogil:
        while t < n and status == 0:
            np_, used, boff = 0, 0, 0
            # gather one run: pieces that follow each other in the file
            while t < n and np_ < max_run:
                row = P + t * _P_WIDTH
                # a unit is one element, or one file row of a tensor read transposed
                units = row[_P_ROWS] if row[_P_FLIP] else row[_P_COUNT]
                unit_bytes = ((row[_P_COLS] if row[_P_FLIP] else 1)
                              * (4 if row[_P_KIND] == 0 else 2))
                if units == 0 or unit_bytes == 0:
                    t, u = t + 1, 0
                    continue
                pos = row[_P_OFFSET] + u * unit_bytes
                if np_ and pos != run_end:
                    break
                direct = row[_P_KIND] == 0 and row[_P_FLIP] == 0
                room = run_bytes - used
                if not direct and <Py_ssize_t>cap - boff < room:
                    room = <Py_ssize_t>cap - boff
                take = room // unit_bytes
                if take > units - u:
                    take = units - u
                elif row[_P_FLIP] and take > 16:
                    take -= take % 16  # whole blocks: transposed pieces keep whole cache lines
                if take <= 0:
                    if np_:
                        break
                    take = 1  # one unit larger than the limits
                    if not direct and <size_t>unit_bytes > cap:
                        grown = <char *>malloc(<size_t>unit_bytes)
                        if grown == NULL:
                            status = 3
                            break
                        free(bounce)
                        free(conv)
                        conv = NULL
                        bounce, cap = grown, <size_t>unit_bytes
                if row[_P_KIND] != 0 and row[_P_FLIP] and conv == NULL:
                    conv = <float *>malloc(cap * 2)  # widened: twice the bytes
                    if conv == NULL:
                        status = 3
                        break
                if np_ == 0:
                    run_start = pos
                pieces[np_].t, pieces[np_].u0, pieces[np_].take = t, u, take
                if direct:
                    pieces[np_].boff = -1
                    iov[np_].iov_base = <void *>(out + row[_P_START] + u)
                else:
                    pieces[np_].boff = boff
                    iov[np_].iov_base = <void *>(bounce + boff)
                    boff += (take * unit_bytes + 63) & ~(<Py_ssize_t>63)  # pieces 64-byte aligned
                iov[np_].iov_len = <size_t>(take * unit_bytes)
                used += take * unit_bytes
                run_end = pos + take * unit_bytes
                np_ += 1
                u += take
                if u == units:
                    t, u = t + 1, 0
            if status or np_ == 0:
                break
            # read the run: preadv until every piece is full
            pos, i = run_start, 0
            while i < np_:
                got = preadv(fd, iov + i, np_ - i, pos)
                if got < 0:
                    if errno == EINTR:
                        continue
                    status, detail = 2, errno
                    break
                if got == 0:
                    status, detail = 1, pieces[i].t
                    break
                pos += got
                while i < np_ and <size_t>got >= iov[i].iov_len:
                    got -= <long long>iov[i].iov_len
                    i += 1
                if got:
                    iov[i].iov_base = <void *>(<char *>iov[i].iov_base + got)
                    iov[i].iov_len -= <size_t>got
            if status:
                break
            for i in range(np_):
                _finish_piece(P + pieces[i].t * _P_WIDTH, out, bounce, conv, pieces + i,
                              nbad + pieces[i].t)
    free(bounce)
    free(conv)
    free(iov)
    free(pieces)
    if status == 3:
        raise MemoryError("no memory for the read's bounce buffer")
    return status, detail
