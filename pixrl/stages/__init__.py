"""The stage layer: completion checks (one table), records, atomic commits and metric logging
for every stage of every flow, over whichever engine `run.engine` names."""
