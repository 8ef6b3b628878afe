-- Why a grid job's engine keeps it waiting (Slurm's or HTCondor's pending reason), in the words
-- its target maps it to, as of the last poll; NULL while the engine does not keep it waiting,
-- and for rows written before this migration (they get it at their next poll). `devctl job show`
-- reads it as the QUEUED job's "waiting".
ALTER TABLE grid_jobs ADD COLUMN engine_waiting TEXT;
