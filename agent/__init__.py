"""The tier agent: keeps a replica's KV blocks across DRAM, NVMe and a fleet-shared tier."""
