-- Node and GPU operations (issue 14).
-- drain: the admin's Drain as JSON ({"reason", "since", "by"}) while a node or GPU is drained:
-- nothing new is placed there, what runs keeps running. NULL when in service.
ALTER TABLE nodes ADD COLUMN drain TEXT COLLATE "C";
ALTER TABLE gpus ADD COLUMN drain TEXT COLLATE "C";
-- Set by `devctl admin node rm` (an offline node with nothing left on it). A removed node is
-- not listed and gets nothing; its rows stay for the history of the sessions, jobs and images
-- that ran there. Its agent registering again brings it back (undrained, as new).
ALTER TABLE nodes ADD COLUMN removed_at TEXT COLLATE "C";
