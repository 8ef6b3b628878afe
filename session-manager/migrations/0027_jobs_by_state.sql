-- The jobs by state, every state: `/metrics` counts them at each scrape, and without an index
-- the count reads every row of the table (the ended jobs, most of it, stay until retention
-- removes them). It serves the reads of the live states too, so their partial index (0007) goes.
CREATE INDEX jobs_state ON jobs (state);
DROP INDEX jobs_active;
