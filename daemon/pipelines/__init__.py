"""The checkpoint and restore job bodies, and the phases they share.

A process tree: ``checkpoint.run_checkpoint``, ``restore.run_restore``. A container:
``container_checkpoint.run_container_checkpoint``, ``container_restore.run_container_restore``
(which also holds the restore phases a process tree's restore uses: pulling into staging,
device memory, figures), with ``container_upload`` (parts uploaded during the export).
Shared phases: ``hooks`` (per-workload commands), ``progress`` (CRIU's progress as the job's),
``gpu_memory`` (device memory in the store), ``gpu_tree`` (a tree's GPU facts; a tree whose GPU
restore failed), ``rescue`` (a dump that failed: thaw and resume), ``recovery`` (the dump
record a crashed daemon's successor settles).
"""
