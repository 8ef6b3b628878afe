//! The SSH public key `devctl key add` registers: which file (the one named, else the first of
//! `~/.ssh/id_ed25519.pub`, `id_ecdsa.pub`, `id_rsa.pub`), and a check that it holds one public
//! key in OpenSSH's one-line format. A private key is refused before anything is sent. The
//! manager parses the key itself and computes its fingerprint; this check only catches the
//! mistakes people make with files.

use std::path::{Path, PathBuf};

/// The files tried, in order, when no file is named (relative to the home directory).
pub const DEFAULT_FILES: [&str; 3] = [
    ".ssh/id_ed25519.pub",
    ".ssh/id_ecdsa.pub",
    ".ssh/id_rsa.pub",
];

const KEYGEN_HINT: &str = "create a key pair with ssh-keygen -t ed25519";

/// A public key read from a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicKeyFile {
    pub path: PathBuf,
    /// The key's line as the file has it, surrounding blanks removed: `ssh-ed25519 AAAA... comment`.
    pub line: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublicKeyError {
    #[error("HOME is not set, so devctl cannot look for ~/.ssh/id_ed25519.pub: name the file, like devctl key add ~/.ssh/id_ed25519.pub")]
    NoHome,
    #[error(
        "no SSH public key found (tried {}): {KEYGEN_HINT}, or name the file: devctl key add FILE",
        list(tried)
    )]
    NoDefault { tried: Vec<PathBuf> },
    #[error("public key file {} does not exist: {KEYGEN_HINT}, or name another file", path.display())]
    Missing { path: PathBuf },
    #[error("cannot read public key file {}: {cause}", path.display())]
    Unreadable { path: PathBuf, cause: String },
    #[error("{} is a private key, which must never leave your machine: give its public key{}", path.display(), public_hint(public.as_deref()))]
    PrivateKey {
        path: PathBuf,
        /// The matching `.pub` file, when it exists.
        public: Option<PathBuf>,
    },
    #[error("{} is not an OpenSSH public key ({problem}): give the .pub file ssh-keygen wrote, like ~/.ssh/id_ed25519.pub", path.display())]
    NotAPublicKey { path: PathBuf, problem: String },
    #[error("{} holds {count} keys: give a file with one public key, like ~/.ssh/id_ed25519.pub", path.display())]
    SeveralKeys { path: PathBuf, count: usize },
}

fn list(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn public_hint(public: Option<&Path>) -> String {
    match public {
        Some(public) => format!(", devctl key add {}", public.display()),
        None => ", the .pub file ssh-keygen wrote beside it".to_owned(),
    }
}

/// Reads the key of `file`, or of the first default file that exists under `home`.
pub fn load(file: Option<&Path>, home: Option<&Path>) -> Result<PublicKeyFile, PublicKeyError> {
    let path = match file {
        Some(file) => file.to_path_buf(),
        None => default_file(home.ok_or(PublicKeyError::NoHome)?)?,
    };
    let text = std::fs::read_to_string(&path).map_err(|err| match err.kind() {
        std::io::ErrorKind::NotFound => PublicKeyError::Missing { path: path.clone() },
        // Binary content: certainly no OpenSSH public key.
        std::io::ErrorKind::InvalidData => PublicKeyError::NotAPublicKey {
            path: path.clone(),
            problem: "it is not text".to_owned(),
        },
        _ => PublicKeyError::Unreadable {
            path: path.clone(),
            cause: err.to_string(),
        },
    })?;
    let line = parse(&text).map_err(|problem| match problem {
        Problem::PrivateKey => PublicKeyError::PrivateKey {
            public: public_beside(&path),
            path: path.clone(),
        },
        Problem::Several(count) => PublicKeyError::SeveralKeys {
            path: path.clone(),
            count,
        },
        Problem::Invalid(problem) => PublicKeyError::NotAPublicKey {
            path: path.clone(),
            problem,
        },
    })?;
    Ok(PublicKeyFile { path, line })
}

fn default_file(home: &Path) -> Result<PathBuf, PublicKeyError> {
    let tried: Vec<PathBuf> = DEFAULT_FILES.iter().map(|f| home.join(f)).collect();
    tried
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or(PublicKeyError::NoDefault { tried })
}

/// `id_ed25519.pub` beside a private key `id_ed25519`, when it exists.
fn public_beside(private: &Path) -> Option<PathBuf> {
    let mut name = private.file_name()?.to_os_string();
    name.push(".pub");
    let public = private.with_file_name(name);
    public.is_file().then_some(public)
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Problem {
    PrivateKey,
    Several(usize),
    Invalid(String),
}

/// The one key line of a public key file's text; blank lines and `#` comments are skipped.
fn parse(text: &str) -> Result<String, Problem> {
    if text.contains("PRIVATE KEY-----") || text.starts_with("PuTTY-User-Key-File") {
        return Err(Problem::PrivateKey);
    }
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let Some(first) = lines.first() else {
        return Err(Problem::Invalid("it is empty".to_owned()));
    };
    if first.starts_with("---- BEGIN SSH2 PUBLIC KEY") {
        return Err(Problem::Invalid(
            "it is in RFC 4716 format: convert it with ssh-keygen -i -f FILE".to_owned(),
        ));
    }
    for line in &lines {
        check_line(line)?;
    }
    match lines.as_slice() {
        [line] => Ok((*line).to_owned()),
        several => Err(Problem::Several(several.len())),
    }
}

/// Whether `line` is `<key type> <base64> [comment]`.
fn check_line(line: &str) -> Result<(), Problem> {
    let mut fields = line.split_whitespace();
    let algorithm = fields.next().unwrap_or_default();
    if !is_key_type(algorithm) {
        let shown: String = algorithm.chars().take(40).collect();
        return Err(Problem::Invalid(format!(
            "it starts with {shown:?}, not with a key type like ssh-ed25519"
        )));
    }
    let blob = fields.next().unwrap_or_default();
    if blob.len() < 16 || !is_base64(blob) {
        return Err(Problem::Invalid(format!(
            "the key after {algorithm} is missing or not base64"
        )));
    }
    Ok(())
}

/// OpenSSH key type names: `ssh-ed25519`, `ssh-rsa`, `ecdsa-sha2-nistp256`,
/// `sk-ssh-ed25519@openssh.com`, and their `-cert-v01@openssh.com` forms.
fn is_key_type(name: &str) -> bool {
    (name.starts_with("ssh-") || name.starts_with("ecdsa-") || name.starts_with("sk-"))
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'@' | b'.'))
}

fn is_base64(text: &str) -> bool {
    let body = text.trim_end_matches('=');
    text.len() - body.len() <= 2
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/')
}

#[cfg(test)]
mod tests {
    use super::*;

    const ED25519: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice@laptop";
    const RSA: &str = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7vbqajDhA4cHBbYw== bob";

    #[test]
    fn one_public_key_line_is_taken_as_it_is() {
        assert_eq!(parse(&format!("{ED25519}\n")).unwrap(), ED25519);
        assert_eq!(
            parse(&format!("# my laptop\n\n  {RSA}  \n")).unwrap(),
            RSA,
            "comments and blanks are skipped"
        );
        let no_comment = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTY=";
        assert_eq!(parse(no_comment).unwrap(), no_comment);
    }

    #[test]
    fn private_keys_are_refused() {
        for text in [
            "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n",
            "-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----\n",
            "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n",
            "PuTTY-User-Key-File-3: ssh-ed25519\nEncryption: none\n",
        ] {
            assert_eq!(parse(text), Err(Problem::PrivateKey), "{text}");
        }
    }

    #[test]
    fn other_files_are_named_for_what_they_are() {
        let problem = |text: &str| match parse(text) {
            Err(Problem::Invalid(p)) => p,
            other => panic!("{text:?}: {other:?}"),
        };
        assert_eq!(problem(""), "it is empty");
        assert_eq!(problem("# only a comment\n"), "it is empty");
        assert_eq!(
            problem("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").as_str(),
            "it starts with \"-----BEGIN\", not with a key type like ssh-ed25519"
        );
        assert!(
            problem("---- BEGIN SSH2 PUBLIC KEY ----\nAAAA\n---- END SSH2 PUBLIC KEY ----")
                .contains("RFC 4716")
        );
        assert_eq!(
            problem("from=\"10.0.0.1\" ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMq x"),
            "it starts with \"from=\\\"10.0.0.1\\\"\", not with a key type like ssh-ed25519"
        );
        assert_eq!(
            problem("ssh-ed25519"),
            "the key after ssh-ed25519 is missing or not base64"
        );
        assert_eq!(
            problem("ssh-ed25519 AAAA!!notbase64!!AAAAAAAA x"),
            "the key after ssh-ed25519 is missing or not base64"
        );
        assert_eq!(
            parse(&format!("{ED25519}\n{RSA}\n")),
            Err(Problem::Several(2))
        );
    }

    #[test]
    fn the_first_default_file_that_exists_is_used() {
        let home = tempfile::tempdir().unwrap();
        let ssh = home.path().join(".ssh");
        std::fs::create_dir(&ssh).unwrap();
        let err = load(None, Some(home.path())).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "no SSH public key found (tried {h}/.ssh/id_ed25519.pub, {h}/.ssh/id_ecdsa.pub, \
                 {h}/.ssh/id_rsa.pub): create a key pair with ssh-keygen -t ed25519, or name the \
                 file: devctl key add FILE",
                h = home.path().display()
            )
        );
        std::fs::write(ssh.join("id_rsa.pub"), RSA).unwrap();
        assert_eq!(
            load(None, Some(home.path())).unwrap().path,
            ssh.join("id_rsa.pub")
        );
        std::fs::write(ssh.join("id_ed25519.pub"), ED25519).unwrap();
        let key = load(None, Some(home.path())).unwrap();
        assert_eq!(key.path, ssh.join("id_ed25519.pub"));
        assert_eq!(key.line, ED25519);
        assert_eq!(load(None, None).unwrap_err(), PublicKeyError::NoHome);
    }

    #[test]
    fn a_private_key_file_points_at_its_public_key() {
        let dir = tempfile::tempdir().unwrap();
        let private = dir.path().join("id_ed25519");
        std::fs::write(
            &private,
            "-----BEGIN OPENSSH PRIVATE KEY-----\nx\n-----END OPENSSH PRIVATE KEY-----\n",
        )
        .unwrap();
        let err = load(Some(&private), None).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{} is a private key, which must never leave your machine: give its public key, \
                 the .pub file ssh-keygen wrote beside it",
                private.display()
            )
        );
        std::fs::write(dir.path().join("id_ed25519.pub"), ED25519).unwrap();
        let err = load(Some(&private), None).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{p} is a private key, which must never leave your machine: give its public key, \
                 devctl key add {p}.pub",
                p = private.display()
            )
        );
    }

    #[test]
    fn a_missing_file_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope.pub");
        assert_eq!(
            load(Some(&path), None).unwrap_err().to_string(),
            format!(
                "public key file {} does not exist: create a key pair with ssh-keygen -t \
                 ed25519, or name another file",
                path.display()
            )
        );
    }
}
