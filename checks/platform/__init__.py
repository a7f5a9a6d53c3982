"""Platform checks: instance profiles, PCI bus enumeration, cloud maintenance events."""
