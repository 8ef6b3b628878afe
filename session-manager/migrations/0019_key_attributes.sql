-- The VOMS attributes (FQANs) of the credential each SSH key was last registered with, so the
-- gateway's login re-checks the site's [policy] admission on what the key's owner showed: a JSON
-- array of FQAN strings; NULL for keys registered before this migration (checked as showing
-- none, so a user admitted by VO registers the key again with a VOMS proxy).
ALTER TABLE ssh_keys ADD COLUMN fqans TEXT;
