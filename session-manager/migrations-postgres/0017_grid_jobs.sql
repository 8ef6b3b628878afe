-- ongrid-manager schema, version 17: jobs handed to grid targets (Slurm, HTCondor). Never edit
-- a migration once released. Times are RFC 3339 UTC text with nanoseconds, as in 0001.

-- One row per job of a grid target (none for the local target). target: slurm or htcondor;
-- account: the local account it runs under (the site's mapping of the owner's DN or group);
-- engine_id: the engine's job id (NULL until the engine answered the submission; stored
-- before the submission's answer); submit_started_at: when the manager began to hand it to
-- the engine (NULL: not yet, a re-queued job of a chain the mirroring loop submits);
-- engine_restarts: how many times the engine had re-queued its engine job when this job began
-- (jobs of a chain re-queued by the engine share the engine id); engine_state/polled_at: what
-- the engine said last, in its words; engine_final: the engine has ended (or forgotten) it.
CREATE TABLE grid_jobs (
    job_id             TEXT COLLATE "C" PRIMARY KEY NOT NULL REFERENCES jobs(id),
    target             TEXT COLLATE "C" NOT NULL,
    account            TEXT COLLATE "C" NOT NULL,
    engine_id          TEXT COLLATE "C",
    submit_started_at  TEXT COLLATE "C",
    engine_restarts    BIGINT NOT NULL DEFAULT 0,
    engine_state       TEXT COLLATE "C",
    polled_at          TEXT COLLATE "C",
    engine_final       BOOLEAN NOT NULL DEFAULT FALSE
);
CREATE INDEX grid_jobs_open ON grid_jobs(engine_final) WHERE NOT engine_final;
