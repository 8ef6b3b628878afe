//! Making the session's user exist inside a dev container before its first start: the lines
//! added to `/etc/passwd` and `/etc/group`, and the tar archives Docker's archive API moves them
//! in. Pure functions over bytes, so they are tested without Docker.

use std::io::Read;

use ongrid_core::api::ContainerUser;

/// Why an account file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum AccountsError {
    #[error("reading the tar archive of {file}")]
    Tar {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the archive of {0} has no regular file in it: is it a symbolic link in the image?")]
    NoFile(String),
    #[error("{0} is not UTF-8 text")]
    NotText(String),
}

/// The login shell every user gets; the stream endpoint starts it (or `/bin/sh` when an image
/// lacks it).
pub const LOGIN_SHELL: &str = "/bin/bash";

/// A file of the container's `/etc` as the archive API gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcFile {
    /// The file name inside `/etc`, e.g. `passwd`.
    pub name: String,
    pub mode: u32,
    pub text: String,
}

/// `/etc/passwd` with the user's line: added when absent, replaced when a line has the same
/// login with other fields, untouched when already right.
pub fn with_user_in_passwd(passwd: &str, user: &ContainerUser) -> String {
    let login = user.name.as_str();
    let line = format!(
        "{login}:x:{uid}:{uid}::/home/{login}:{LOGIN_SHELL}",
        uid = user.uid
    );
    with_line(passwd, login, &line)
}

/// `/etc/group` with the user's own group (same name and id), like [`with_user_in_passwd`].
pub fn with_user_in_group(group: &str, user: &ContainerUser) -> String {
    let login = user.name.as_str();
    let line = format!("{login}:x:{uid}:", uid = user.uid);
    with_line(group, login, &line)
}

/// `text` where the line whose first field is `key` is `line`.
fn with_line(text: &str, key: &str, line: &str) -> String {
    let mut out = String::with_capacity(text.len() + line.len() + 1);
    let mut found = false;
    for existing in text.lines() {
        if existing.split(':').next() == Some(key) {
            if !found {
                out.push_str(line);
                out.push('\n');
            }
            found = true;
        } else {
            out.push_str(existing);
            out.push('\n');
        }
    }
    if !found {
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The first regular file of a tar archive, as the archive API returns one file.
pub fn file_from_tar(archive: &[u8], what: &str) -> Result<EtcFile, AccountsError> {
    let tar_error = |source| AccountsError::Tar {
        file: what.to_owned(),
        source,
    };
    let mut archive = tar::Archive::new(archive);
    for entry in archive.entries().map_err(tar_error)? {
        let mut entry = entry.map_err(tar_error)?;
        if entry.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        let name = entry
            .path()
            .map_err(tar_error)?
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mode = entry.header().mode().map_err(tar_error)?;
        let mut bytes = Vec::new();
        entry.read_to_end(&mut bytes).map_err(tar_error)?;
        let text = String::from_utf8(bytes).map_err(|_| AccountsError::NotText(what.to_owned()))?;
        return Ok(EtcFile { name, mode, text });
    }
    Err(AccountsError::NoFile(what.to_owned()))
}

/// A tar archive of `files`, owned by root, to be extracted into `/etc`.
pub fn tar_of(files: &[EtcFile]) -> Result<Vec<u8>, AccountsError> {
    let mut builder = tar::Builder::new(Vec::new());
    for file in files {
        let tar_error = |source| AccountsError::Tar {
            file: file.name.clone(),
            source,
        };
        let mut header = tar::Header::new_gnu();
        header.set_size(file.text.len() as u64);
        header.set_mode(file.mode);
        header.set_uid(0);
        header.set_gid(0);
        header.set_entry_type(tar::EntryType::Regular);
        header.set_mtime(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        );
        builder
            .append_data(&mut header, &file.name, file.text.as_bytes())
            .map_err(tar_error)?;
    }
    builder.into_inner().map_err(|source| AccountsError::Tar {
        file: "the account files".to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ongrid_core::UserName;

    fn alice() -> ContainerUser {
        ContainerUser {
            name: UserName::parse("alice").unwrap(),
            uid: 20001,
        }
    }

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";

    #[test]
    fn user_is_appended_once() {
        let once = with_user_in_passwd(PASSWD, &alice());
        assert_eq!(
            once,
            format!("{PASSWD}alice:x:20001:20001::/home/alice:/bin/bash\n")
        );
        assert_eq!(with_user_in_passwd(&once, &alice()), once);
    }

    #[test]
    fn a_same_named_user_of_the_image_is_replaced() {
        let image = format!("{PASSWD}alice:x:1000:1000:Alice:/home/alice:/bin/sh\n");
        let out = with_user_in_passwd(&image, &alice());
        assert_eq!(
            out.lines().filter(|l| l.starts_with("alice:")).count(),
            1,
            "{out}"
        );
        assert!(out.contains("alice:x:20001:20001::/home/alice:/bin/bash\n"));
        assert!(out.starts_with("root:x:0:0"));
    }

    #[test]
    fn a_login_that_only_starts_the_same_is_another_user() {
        let image = "alice2:x:1000:1000::/home/alice2:/bin/sh";
        let out = with_user_in_passwd(image, &alice());
        assert!(
            out.starts_with("alice2:x:1000:1000::/home/alice2:/bin/sh\n"),
            "{out}"
        );
        assert!(
            out.ends_with("alice:x:20001:20001::/home/alice:/bin/bash\n"),
            "{out}"
        );
    }

    #[test]
    fn group_is_added() {
        let out = with_user_in_group("root:x:0:\nusers:x:100:\n", &alice());
        assert_eq!(out, "root:x:0:\nusers:x:100:\nalice:x:20001:\n");
        assert_eq!(with_user_in_group(&out, &alice()), out);
    }

    #[test]
    fn tar_round_trip_keeps_name_mode_and_text() {
        let files = [
            EtcFile {
                name: "passwd".into(),
                mode: 0o644,
                text: PASSWD.into(),
            },
            EtcFile {
                name: "group".into(),
                mode: 0o600,
                text: "root:x:0:\n".into(),
            },
        ];
        let archive = tar_of(&files).unwrap();
        assert_eq!(file_from_tar(&archive, "/etc/passwd").unwrap(), files[0]);
    }

    #[test]
    fn an_archive_without_a_file_is_refused() {
        let archive = tar_of(&[]).unwrap();
        let err = file_from_tar(&archive, "/etc/passwd").unwrap_err();
        assert!(matches!(err, AccountsError::NoFile(_)), "{err:?}");
        assert!(file_from_tar(b"not a tar archive at all", "/etc/passwd").is_err());
    }
}
