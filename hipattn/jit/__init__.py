"""The generic compile layer: from a kernel spec to a loaded function, knowing nothing of attention.

``target`` (the GPU a binary is built for), ``params`` (a kernel's by-value argument struct, declared
once for C++ and ctypes), ``spec`` (kernel families and the template arguments of one instantiation),
``sources`` (the compile unit and its headers), ``cache`` (the self-checking on-disk cache) and
``registry`` (in-process dict, then disk, then compiler). The attention kernels themselves are
described in ``hipattn.catalog``; nothing here imports it.
"""
