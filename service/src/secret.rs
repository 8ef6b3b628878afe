//! Secrets read from files: a bearer token is the first line of its file, and it never reaches
//! a log because `Debug` and `Display` print `<secret>`.

use std::fmt;
use std::path::{Path, PathBuf};

/// Why a token file could not be used; the binaries turn this into their own config error,
/// which names the key to fix.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read token file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("token file {0} is empty")]
    Empty(PathBuf),
}

/// A bearer token. `Debug` and `Display` print `<secret>` so it never reaches a log.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    /// Wraps a token; surrounding whitespace is dropped.
    pub fn new(value: &str) -> Self {
        Self(value.trim().to_owned())
    }

    /// Reads the first line of `path`; a missing, unreadable or blank first line is an error.
    pub fn read_first_line(path: &Path) -> Result<Self, TokenError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
            path: path.to_owned(),
            source,
        })?;
        let token = Self::new(text.lines().next().unwrap_or(""));
        if token.0.is_empty() {
            return Err(TokenError::Empty(path.to_owned()));
        }
        Ok(token)
    }

    /// The token itself, for `Authorization` headers and comparisons only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<secret>")
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<secret>")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_never_printed() {
        let token = Token::new("  s3cret\t");
        assert_eq!(token.expose(), "s3cret");
        assert_eq!(format!("{token:?}"), "<secret>");
        assert_eq!(token.to_string(), "<secret>");
        assert_eq!(format!("{:?}", Some(token.clone())), "Some(<secret>)");
    }

    #[test]
    fn only_the_first_line_is_the_token() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "gw-s3cret \n# comment\n").unwrap();
        assert_eq!(Token::read_first_line(&path).unwrap().expose(), "gw-s3cret");
    }

    #[test]
    fn a_blank_or_missing_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "  \nsecond line\n").unwrap();
        let err = Token::read_first_line(&path).unwrap_err();
        assert!(
            matches!(&err, TokenError::Empty(p) if p == &path),
            "{err:?}"
        );

        let missing = dir.path().join("missing");
        let err = Token::read_first_line(&missing).unwrap_err();
        assert!(
            matches!(&err, TokenError::Read { path, .. } if path == &missing),
            "{err:?}"
        );
        assert!(err.to_string().contains(&missing.display().to_string()));
    }
}
