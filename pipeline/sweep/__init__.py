"""The evaluation sweep: every method x engine setting of a grid on LongBench-format data, through the
job's replicas and scheduler, scored into one report."""
