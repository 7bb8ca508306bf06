"""Running read tasks on Ray: the fast-path block stream (plain tasks in a window), the Ray
Data datasource of ``pipe.dataset(e)``, the run's accounts and Ray set-up. The only stage
that imports Ray at module level, with the priority store and the tools."""
