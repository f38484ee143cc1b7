"""``python -m cuep.bench``: cuep's dispatch and combine against NCCL all-to-all and the NVLink limit.

One process drives every local GPU (:func:`cuep.init`), as a notebook would. Modules, lowest first:

* :mod:`~cuep.bench.traffic`  routing and byte accounting (pure NumPy): what crosses NVLink, what is logical;
* :mod:`~cuep.bench.timing`   CUDA-event timing over several GPUs: warm-up, series of runs, medians, cold/warm
  L2, a start gate that lines the GPUs up;
* :mod:`~cuep.bench.ceilings` peer-copy (per pair, all pairs at once) and local-copy bandwidth;
* :mod:`~cuep.bench.nccl`     the NCCL baseline for the same routing (permute, grouped send/recv, unpermute);
* :mod:`~cuep.bench.cases`    inputs and the timed callables of cuep and NCCL for one (format, N);
* :mod:`~cuep.bench.report`   tables, JSON, plots;
* :mod:`~cuep.bench.floor`    ``--floor``: one GPU, each op against a copy of its bytes, the host cost of a call;
* ``__main__``                 the command line.

Importing any of them needs no GPU.
"""
