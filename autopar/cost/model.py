"""Cost model: roofline compute time and alpha-beta collective time on a `LogicalMesh`.

Every collective over a group of n devices is priced with the alpha-beta model: a step costs
alpha (latency) plus bytes * beta (inverse bandwidth). For each collective the cheapest of the
algorithms from the seed notes is taken (ring, tree, butterfly, recursive halving/doubling).

Seed sources (see /work/shared/seeds/README.md):
  [L13] MIT 6.5940 Lecture 13 (seed 000): ring and recursive-halving all-reduce, cost table,
        citing Thakur, Rabenseifner & Gropp, "Optimization of collective communication
        operations in MPICH" (IJHPCA 2005).
  [DTP] Data/tensor/pipeline parallelism lecture (seed 003): ring, tree and butterfly all-reduce.
  [PC]  Parallelization concepts notes (seed 001): all-reduce = reduce-scatter + all-gather;
        all-to-all for expert parallelism.

Pure Python: no JAX import, so the ILP and DP can be tested on numbers alone.
"""
from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.core.errors import InvalidArgumentError
from autopar.core.spec import Spec, num_shards, without_axes
from autopar.cost.cluster import LogicalMesh


class CollectiveAlgorithm(enum.Enum):
    """Collective algorithms the seeds describe; the cost model takes the cheapest."""

    RING = "ring"
    TREE = "tree"
    BUTTERFLY = "butterfly"
    RECURSIVE_HALVING = "recursive_halving"  # recursive halving / doubling (Rabenseifner)


def _check(n: int, nbytes: float, alpha_s: float, beta_s_per_byte: float) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgumentError(f"group size n must be an int >= 1, got {n!r}.")
    if not nbytes >= 0:
        raise InvalidArgumentError(f"nbytes must be >= 0, got {nbytes!r}.")
    if not (alpha_s >= 0 and beta_s_per_byte >= 0):
        raise InvalidArgumentError(
            f"alpha_s and beta_s_per_byte must be >= 0, got {alpha_s!r}, {beta_s_per_byte!r}.")


def _is_power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length()


def all_reduce_options_s(n: int, nbytes: float, alpha_s: float,
                         beta_s_per_byte: float) -> dict[CollectiveAlgorithm, float]:
    """All-reduce of `nbytes` per device over `n` devices, per algorithm.

    With N = nbytes, a = alpha_s, b = beta_s_per_byte, L = ceil(log2 n):
      RING [DTP "Ring AllReduce", L13]: reduce-scatter then all-gather around a ring, 2(n-1)
        steps of N/n bytes:                          2(n-1) a + 2(n-1)/n N b
      TREE [DTP "Tree AllReduce"]: reduce up then broadcast down a binary tree, 2L steps of
        N bytes:                                     2L (a + N b)
      BUTTERFLY [DTP "Butterfly AllReduce"]: log2 n rounds of pairwise exchange of N bytes:
                                                     log2 p (a + N b)
      RECURSIVE_HALVING [L13, Thakur et al. §4.4]: reduce-scatter by recursive halving, then
        all-gather by recursive doubling:            2 log2 p a + 2(p-1)/p N b
    Butterfly and recursive halving need a power of two: for other n they run on
    p = 2^floor(log2 n) devices after the extra n - p devices fold their data in, and unfold the
    result at the end (Thakur et al. §4.4), adding 2 (a + N b). For n == 1 every cost is 0.

    Example:
        >>> all_reduce_options_s(4, 1e6, 0.0, 1e-9)[CollectiveAlgorithm.RING]
        0.0015
    """
    _check(n, nbytes, alpha_s, beta_s_per_byte)
    if n == 1:
        return {alg: 0.0 for alg in CollectiveAlgorithm}
    a, b, size = alpha_s, beta_s_per_byte, float(nbytes)
    p = 1 << (n.bit_length() - 1)
    fold = 0.0 if p == n else 2 * (a + size * b)
    return {
        CollectiveAlgorithm.RING: 2 * (n - 1) * a + 2 * (n - 1) / n * size * b,
        CollectiveAlgorithm.TREE: 2 * _log2_ceil(n) * (a + size * b),
        CollectiveAlgorithm.BUTTERFLY: math.log2(p) * (a + size * b) + fold,
        CollectiveAlgorithm.RECURSIVE_HALVING:
            2 * math.log2(p) * a + 2 * (p - 1) / p * size * b + fold,
    }


def all_gather_options_s(n: int, nbytes: float, alpha_s: float,
                         beta_s_per_byte: float) -> dict[CollectiveAlgorithm, float]:
    """All-gather over `n` devices; `nbytes` is the per-device size of the gathered RESULT.

    Each device receives the (n-1)/n N bytes it does not hold [PC: AllGather; L13]:
      RING: n-1 steps of N/n bytes:                  (n-1) a + (n-1)/n N b
      RECURSIVE_HALVING (recursive doubling, Thakur et al. §4.1; Bruck's variant for n not a
        power of two has the same cost):             ceil(log2 n) a + (n-1)/n N b
    """
    _check(n, nbytes, alpha_s, beta_s_per_byte)
    if n == 1:
        return {CollectiveAlgorithm.RING: 0.0, CollectiveAlgorithm.RECURSIVE_HALVING: 0.0}
    volume = (n - 1) / n * float(nbytes) * beta_s_per_byte
    return {
        CollectiveAlgorithm.RING: (n - 1) * alpha_s + volume,
        CollectiveAlgorithm.RECURSIVE_HALVING: _log2_ceil(n) * alpha_s + volume,
    }


def reduce_scatter_options_s(n: int, nbytes: float, alpha_s: float,
                             beta_s_per_byte: float) -> dict[CollectiveAlgorithm, float]:
    """Reduce-scatter over `n` devices; `nbytes` is the per-device size of the INPUT.

    The first half of a ring / recursive-halving all-reduce [PC: AllReduce = ReduceScatter +
    AllGather; L13]:
      RING: n-1 steps of N/n bytes:                  (n-1) a + (n-1)/n N b
      RECURSIVE_HALVING (power-of-two n only, Thakur et al. §4.3; otherwise pairwise exchange,
        which costs the same as RING):               log2 n a + (n-1)/n N b
    """
    _check(n, nbytes, alpha_s, beta_s_per_byte)
    if n == 1:
        return {CollectiveAlgorithm.RING: 0.0, CollectiveAlgorithm.RECURSIVE_HALVING: 0.0}
    volume = (n - 1) / n * float(nbytes) * beta_s_per_byte
    out = {CollectiveAlgorithm.RING: (n - 1) * alpha_s + volume}
    if _is_power_of_two(n):
        out[CollectiveAlgorithm.RECURSIVE_HALVING] = math.log2(n) * alpha_s + volume
    return out


def all_to_all_options_s(n: int, nbytes: float, alpha_s: float,
                         beta_s_per_byte: float) -> dict[CollectiveAlgorithm, float]:
    """All-to-all over `n` devices; `nbytes` is the per-device bytes held (before and after).

    Pairwise exchange in ring order [PC: All-to-All; Thakur et al. §4.5]: in step k device i
    sends its N/n block for device i+k:              (n-1) a + (n-1)/n N b
    """
    _check(n, nbytes, alpha_s, beta_s_per_byte)
    if n == 1:
        return {CollectiveAlgorithm.RING: 0.0}
    return {CollectiveAlgorithm.RING:
            (n - 1) * alpha_s + (n - 1) / n * float(nbytes) * beta_s_per_byte}


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Seconds for compute, collectives and resharding on one logical mesh.

    A collective over several mesh axes runs over the product of their sizes with the largest
    alpha and beta among them (the slowest link bounds the group).

    Example:
        >>> from autopar.cost.cluster import ClusterSpec
        >>> cm = CostModel(mesh=ClusterSpec.preset("cpu").logical_mesh((2, 4)))
        >>> cm.all_reduce_s(0, axes=[0]) > 0, cm.all_reduce_s(1e6, axes=[]) == 0.0
        (True, True)
    """

    mesh: LogicalMesh

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, LogicalMesh):
            raise InvalidArgumentError(
                f"CostModel.mesh must be a LogicalMesh, got {type(self.mesh).__name__}; build "
                f"one with ClusterSpec.logical_mesh(shape).")

    def all_reduce_s(self, nbytes: float, axes: Sequence[int]) -> float:
        """All-reduce of `nbytes` per device over mesh `axes`: min over algorithms."""
        return self._cheapest(all_reduce_options_s, nbytes, axes)

    def all_reduce_algorithm(self, nbytes: float, axes: Sequence[int]) -> CollectiveAlgorithm:
        """The algorithm `all_reduce_s` prices: the cheapest at this size among those the
        backend implements (the dump names it). NCCL (the GPU presets) has ring and tree: tree
        for small messages, ring for large, as NCCL itself switches; with every algorithm
        allowed, small messages favour butterfly and large ones recursive halving.

        Example:
            >>> from autopar.cost.cluster import ClusterSpec
            >>> cm = CostModel(mesh=ClusterSpec.preset("dgx-a100").logical_mesh((1, 8)))
            >>> cm.all_reduce_algorithm(1e3, [1]).value, cm.all_reduce_algorithm(1e9, [1]).value
            ('tree', 'ring')
        """
        options = self._options(all_reduce_options_s, nbytes, axes)
        return min(options, key=options.get)

    def all_gather_s(self, nbytes: float, axes: Sequence[int]) -> float:
        """All-gather over mesh `axes`; `nbytes` is the per-device size of the result."""
        return self._cheapest(all_gather_options_s, nbytes, axes)

    def reduce_scatter_s(self, nbytes: float, axes: Sequence[int]) -> float:
        """Reduce-scatter over mesh `axes`; `nbytes` is the per-device size of the input. On a
        backend that compiles it as an all-reduce and a slice, that all-reduce."""
        if self.mesh.reduce_scatter_is_all_reduce:
            return self.all_reduce_s(nbytes, axes)
        return self._cheapest(reduce_scatter_options_s, nbytes, axes)

    def all_to_all_s(self, nbytes: float, axes: Sequence[int]) -> float:
        """All-to-all over mesh `axes`; `nbytes` is the per-device bytes held."""
        return self._cheapest(all_to_all_options_s, nbytes, axes)

    def collective_permute_s(self, nbytes: float, axes: Sequence[int]) -> float:
        """Collective-permute within groups over mesh `axes`: every device sends the `nbytes`
        it holds to one other device, one step: alpha + nbytes * beta (0 for one device)."""
        n, alpha_s, beta_s_per_byte = self._group(axes)
        if not nbytes >= 0:
            raise InvalidArgumentError(f"nbytes must be >= 0, got {nbytes!r}.")
        return 0.0 if n == 1 else alpha_s + float(nbytes) * beta_s_per_byte

    def compute_s(self, flops: float, nbytes: float, dtype_name: str) -> float:
        """Roofline time on one device: max(flops / peak(dtype), nbytes / HBM bandwidth)."""
        if not (flops >= 0 and nbytes >= 0):
            raise InvalidArgumentError(
                f"compute_s needs flops >= 0 and nbytes >= 0, got flops={flops!r}, "
                f"nbytes={nbytes!r}.")
        return max(flops / self.mesh.peak_flops_per_s(dtype_name),
                   nbytes / self.mesh.hbm_bandwidth_bytes_per_s)

    def reshard_s(self, shape: Sequence[int], itemsize: int, src: Spec, dst: Spec) -> float:
        """Seconds to move a tensor from layout `src` to layout `dst`.

        Per mesh axis a:
          - same dim in src and dst, same axes before it in that dim (or unused in both): free;
          - used by dst only: free (each device slices its replicated copy);
          - used by src only: an all-gather over a;
          - used by both on different dims, or at a different position within one dim: an
            all-to-all over a, on the per-device bytes under `src`.
        The all-to-alls run first; the all-gathers then run one axis at a time, each on the
        per-device result size of the layout gathered so far, in the cheapest order.
        XLA's SPMD partitioner turns only a lone moved axis into an all-to-all: when an axis
        moves and any other axis changes too, it replicates the tensor and re-partitions it
        ("involuntary full rematerialization"), so that case costs gathering every axis of
        `src`.
        """
        shape = tuple(shape)
        self._check_spec(shape, src, "src")
        self._check_spec(shape, dst, "dst")
        if src == dst:
            return 0.0
        mesh_shape = self.mesh.shape
        total_bytes = float(math.prod(shape)) * itemsize
        where_src, where_dst = _placement(src), _placement(dst)
        moved, gathered = [], []
        for axis, n in enumerate(mesh_shape):
            if n == 1 or axis not in where_src:
                continue
            if axis not in where_dst:
                gathered.append(axis)
            elif where_src[axis] != where_dst[axis]:
                moved.append(axis)
        if moved and len(moved) + len(gathered) > 1:   # replicate, then re-partition
            gathered, moved = gathered + moved, []
        per_device = total_bytes / num_shards(src, mesh_shape)
        cost = sum(self.all_to_all_s(per_device, [a]) for a in moved)
        if gathered:
            cost += min(self._gather_sequence_s(total_bytes, src, order)
                        for order in itertools.permutations(gathered))
        return cost

    def _gather_sequence_s(self, total_bytes: float, spec: Spec, order: Sequence[int]) -> float:
        cost = 0.0
        for axis in order:
            spec = without_axes(spec, [axis])
            cost += self.all_gather_s(total_bytes / num_shards(spec, self.mesh.shape), [axis])
        return cost

    def _check_spec(self, shape: tuple[int, ...], spec: Spec, which: str) -> None:
        if len(spec) != len(shape):
            raise InvalidArgumentError(
                f"reshard_s: {which} spec {spec} has rank {len(spec)} but the tensor shape "
                f"{shape} has rank {len(shape)}; give one entry per dimension.")
        rank = len(self.mesh.shape)
        for dim in spec:
            for a in dim:
                if not 0 <= a < rank:
                    raise InvalidArgumentError(
                        f"reshard_s: {which} spec {spec} uses mesh axis {a} but the mesh "
                        f"{self.mesh.shape} has axes 0..{rank - 1}.")

    def _group(self, axes: Sequence[int]) -> tuple[int, float, float]:
        """(group size, alpha, beta) for a collective over `axes`; size-1 axes are ignored."""
        mesh = self.mesh
        axes = tuple(axes)
        if len(set(axes)) != len(axes):
            raise InvalidArgumentError(f"collective axes {axes} repeat an axis; list each once.")
        for a in axes:
            if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < len(mesh.shape):
                raise InvalidArgumentError(
                    f"collective axis {a!r} is not an axis of mesh {mesh.shape} "
                    f"(valid: 0..{len(mesh.shape) - 1}).")
        real = [a for a in axes if mesh.shape[a] > 1]
        if not real:
            return 1, 0.0, 0.0
        return (math.prod(mesh.shape[a] for a in real), max(mesh.alpha_s[a] for a in real),
                max(mesh.beta_s_per_byte[a] for a in real))

    def _options(self, options, nbytes: float, axes: Sequence[int],
                 ) -> dict[CollectiveAlgorithm, float]:
        """Time per algorithm the backend implements (`mesh.collective_algorithms`; all of
        them when it names none, or none that applies to this collective)."""
        n, alpha_s, beta_s_per_byte = self._group(axes)
        if n == 1 and not nbytes >= 0:
            raise InvalidArgumentError(f"nbytes must be >= 0, got {nbytes!r}.")
        got = options(n, nbytes, alpha_s, beta_s_per_byte) if n > 1 else \
            {CollectiveAlgorithm.RING: 0.0}
        allowed = self.mesh.collective_algorithms
        kept = {a: t for a, t in got.items() if a.value in allowed}
        return kept or got

    def _cheapest(self, options, nbytes: float, axes: Sequence[int]) -> float:
        return min(self._options(options, nbytes, axes).values())


def _placement(spec: Spec) -> dict[int, tuple[int, tuple[int, ...]]]:
    """mesh axis -> (tensor dim, axes before it in that dim): what shard it selects."""
    return {a: (d, dim[:i]) for d, dim in enumerate(spec) for i, a in enumerate(dim)}
