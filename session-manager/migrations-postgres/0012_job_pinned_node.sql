-- ongrid-manager schema, version 12: re-queued jobs pinned to their checkpoint's node. Never
-- edit a migration once released.

-- pinned_node: the only node the job may start on, because its restart chain's working
-- directory (its checkpoint) is there; NULL: anywhere (a first job, or a site whose jobs
-- directory is shared storage, `[jobs] shared_work_dir`). Not a foreign key: the job is FAILED,
-- not blocked, when that node is removed.
ALTER TABLE jobs ADD COLUMN pinned_node TEXT COLLATE "C";
