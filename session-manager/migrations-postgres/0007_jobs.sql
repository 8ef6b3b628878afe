-- ongrid-manager schema, version 7: batch jobs. Never edit a migration once released.
-- Times are RFC 3339 UTC text with nanoseconds, as in 0001.

-- A batch job (local target). spec: the validated JobSpec as JSON (core/src/job.rs); state:
-- GPULab's (QUEUED, RUNNING, MUSTHALT, HALTING, HALTED, FINISHED, FAILED, CANCELLED), always
-- the last row of job_transitions; max_duration_secs: what it runs under (NULL: no limit);
-- image_digest/docker_image: the frozen image resolved at submit; node/gpus: where it runs or
-- ran; chain_initial/restart_count: its restart chain; previous_job/next_job: the links of the
-- chain; log_size: how many bytes of its output the manager has consumed (the agent's offset),
-- log_complete: nothing follows them. The output itself is a file per job (job_log_dir).
CREATE TABLE jobs (
    id                 TEXT COLLATE "C" PRIMARY KEY NOT NULL,
    owner              TEXT COLLATE "C" NOT NULL REFERENCES users(dn),
    state              TEXT COLLATE "C" NOT NULL,
    spec               TEXT COLLATE "C" NOT NULL,
    max_duration_secs  BIGINT,
    image_digest       TEXT COLLATE "C" NOT NULL,
    docker_image       TEXT COLLATE "C" NOT NULL,
    node               TEXT COLLATE "C" REFERENCES nodes(name),
    gpus               TEXT COLLATE "C" NOT NULL DEFAULT '[]',
    chain_initial      TEXT COLLATE "C" NOT NULL,
    restart_count      BIGINT NOT NULL,
    previous_job       TEXT COLLATE "C" REFERENCES jobs(id),
    next_job           TEXT COLLATE "C" REFERENCES jobs(id),
    exit_code          BIGINT,
    log_size           BIGINT NOT NULL DEFAULT 0,
    log_complete       BOOLEAN NOT NULL DEFAULT FALSE,
    queued_at          TEXT COLLATE "C" NOT NULL
);
CREATE INDEX jobs_owner ON jobs(owner);
CREATE INDEX jobs_active ON jobs(state) WHERE state IN ('QUEUED', 'RUNNING', 'MUSTHALT', 'HALTING');
CREATE INDEX jobs_node ON jobs(node);
CREATE INDEX jobs_chain ON jobs(chain_initial);

-- Every change of a job's state; reason is the typed JobReason as JSON.
CREATE TABLE job_transitions (
    job_id      TEXT COLLATE "C" NOT NULL REFERENCES jobs(id),
    seq         BIGINT NOT NULL,
    from_state  TEXT COLLATE "C",
    to_state    TEXT COLLATE "C" NOT NULL,
    at          TEXT COLLATE "C" NOT NULL,
    reason      TEXT COLLATE "C" NOT NULL,
    PRIMARY KEY (job_id, seq)
);
