"""Job plans: the logical graph the DataStream API builds, and the physical
graph of chained vertices and partitioned edges that the runtime deploys."""
