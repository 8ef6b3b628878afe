-- Which write last changed each job, by the counter of the sessions' changes (0024), bumped in
-- every write that creates a job, changes its state or its chain's links: a manager keeps the
-- jobs it plans with (QUEUED or holding GPUs) and reads again only those changed since it last
-- looked, where every round read every such job and its history.
ALTER TABLE jobs ADD COLUMN change_seq BIGINT NOT NULL DEFAULT 0;
CREATE INDEX jobs_by_change ON jobs (change_seq);
-- The change number of the last write that deleted jobs (an ended job removed or pruned): a
-- deleted row leaves no stamp to read, so a manager whose kept jobs are older reads them whole
-- again.
CREATE TABLE job_deletion_seq (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    seq BIGINT NOT NULL
);
