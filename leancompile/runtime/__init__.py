"""What executes at run time: P2P ops, schedule executors, memory accounting.

Empty in this version: the FlashOverlap P2P ops and the LeanGRPO schedule executors land here.
"""

__all__: list[str] = []
