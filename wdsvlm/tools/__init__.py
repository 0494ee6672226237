"""The command line and the tools behind it: inspect, stats, pictures, benches."""
