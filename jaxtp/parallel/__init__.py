"""The device mesh and what runs on it: mesh building (ICI x DCN), the sharding tables (the only
code that writes PartitionSpecs), the Megatron collectives, the two execution modes' operators,
ring attention, the data-parallel gradient sync, multi-process start-up, and the validation of a
config on a mesh."""
