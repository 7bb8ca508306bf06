"""Running work on Ray: the fast-path block stream (read tasks in a window), the Ray Data
datasource of ``pipe.dataset(e)``, the run's accounts, packing on Ray, progress bars and Ray
set-up. With the priority store and the tools, the only code that imports Ray at module
level."""
