"""What a run is asked and decides, before anything runs: the settings that are flags
(`settings.py`), the partition request and its one resolution (`partition.py`), who
owns what (`topology.py`) and where each task runs (`sites.py`), and what a run records
about itself (`record.py`). Pure arithmetic: no StarPU, no numpy on import of the package."""
