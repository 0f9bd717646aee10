"""The device mesh's axis names, shared by the sharding rules and the M2PO scopes."""

MESH_AXES = ("data", "fsdp", "tensor")  # every mesh has these three, in this order
BATCH_AXES = ("data", "fsdp")  # the axes that split a batch's rows
