"""hkvd benchmarks: ``python -m bench {store_retrieve,control_plane,scale,all} [--quick]``.

Every figure is reported next to a reference measured in the same run on the same buffers
(memcpy, raw ``process_vm_readv``/``writev``, memset), because shared machines are noisy: the
ratios carry over between machines, the absolute numbers do not. See README.md, "Benchmarks".
"""
