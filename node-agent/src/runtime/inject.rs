//! ongrid's tools injected into dev containers, all under [`INJECTED_ROOT`] (`/run/ongrid`), the
//! one directory a frozen image leaves out. Today there is one: the node's own `sftp-server`,
//! lent to an image that has none ([`SftpInjector`]).
//!
//! The server is copied together with the shared libraries it needs and the node's dynamic
//! loader, and run through that loader, so it works whatever C library the image has, or none:
//!
//! ```text
//! /run/ongrid/sftp/lib/<loader> --library-path /run/ongrid/sftp/lib /run/ongrid/sftp/sftp-server
//! ```
//!
//! The loader is the binary's ELF program interpreter (`PT_INTERP`, [`elf_interpreter`]); the
//! libraries are what the node's `ldd` resolves for it ([`parse_ldd`]): ldd follows the
//! dependencies of dependencies and the node's own search path and cache, which the agent
//! would otherwise have to reimplement. A binary without an interpreter (static) is copied
//! alone and run directly.
//!
//! Everything is uploaded in one tar archive through Docker's archive API, owned by root with
//! modes 0555 (programs and libraries) and 0755 (directories), so the container's user can run
//! it but not change it. Docker creates a missing `/run` (0755, root) itself, so an image
//! without one works too, and an existing `/run` keeps its mode. The last entry of the archive
//! is [`SFTP_COMMAND_FILE`], the command that runs the server: a bundle cut short (the agent
//! stopped mid-upload) has none and is uploaded again.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use tracing::{info, warn};

use super::accounts;
use super::{error_chain, ContainerRuntime, RuntimeError};

/// Where every tool ongrid puts into a container lives.
pub const INJECTED_ROOT: &str = "/run/ongrid";
/// The injected sftp server and its command file.
pub const SFTP_DIR: &str = "/run/ongrid/sftp";
/// The loader and libraries of the injected sftp server.
pub const SFTP_LIB_DIR: &str = "/run/ongrid/sftp/lib";
/// The injected sftp server itself.
pub const SFTP_SERVER: &str = "/run/ongrid/sftp/sftp-server";
/// The command that runs the injected server, one argument a line; written last, so it exists
/// only when the whole bundle does.
pub const SFTP_COMMAND_FILE: &str = "/run/ongrid/sftp/command";
/// The most the agent copies into a container for sftp.
pub const MAX_BUNDLE_BYTES: u64 = 32 << 20;

/// Where images and nodes put `sftp-server`, in the order they are tried: Debian and Ubuntu,
/// Arch, Fedora and RHEL, others, Alpine.
pub const SFTP_SERVER_PATHS: [&str; 5] = [
    "/usr/lib/openssh/sftp-server",
    "/usr/lib/sftp-server",
    "/usr/libexec/openssh/sftp-server",
    "/usr/libexec/sftp-server",
    "/usr/lib/ssh/sftp-server",
];

/// How long `ldd` may take.
const LDD_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the sftp server could not be lent to a container.
#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    #[error("this node has no sftp-server either (looked for {searched}): install openssh-sftp-server on the node")]
    NoHostServer { searched: String },
    #[error("reading {} on the node", .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} on the node is not a usable executable: {problem}", .path.display())]
    NotElf { path: PathBuf, problem: ElfError },
    #[error("running `ldd {}` on the node: {problem}", .path.display())]
    Ldd { path: PathBuf, problem: String },
    #[error("{} on the node needs {library}, which ldd cannot find: reinstall its package on the node", .path.display())]
    LibraryMissing { path: PathBuf, library: String },
    #[error("the sftp-server of the node with its libraries takes at least {bytes} bytes, over the limit of {limit} bytes ongrid copies into a container: install openssh-sftp-server in the image instead")]
    TooLarge { bytes: u64, limit: u64 },
    #[error("building the archive of the sftp server")]
    Tar(#[source] std::io::Error),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

/// Why an ELF file's program interpreter could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ElfError {
    #[error("not an ELF file")]
    NotElf,
    #[error("unknown ELF class or byte order")]
    UnknownFormat,
    #[error("the ELF file is truncated")]
    Truncated,
    #[error("the program interpreter is not a plain UTF-8 path")]
    BadInterpreter,
}

/// The program interpreter (`PT_INTERP`) of an ELF executable, e.g.
/// `/lib64/ld-linux-x86-64.so.2`; `None` for a static one. 32- and 64-bit, either byte order.
pub fn elf_interpreter(elf: &[u8]) -> Result<Option<String>, ElfError> {
    const PT_INTERP: u64 = 3;
    if elf.get(..4) != Some(b"\x7fELF".as_slice()) {
        return Err(ElfError::NotElf);
    }
    let big_endian = match elf.get(5) {
        Some(1) => false,
        Some(2) => true,
        _ => return Err(ElfError::UnknownFormat),
    };
    let read = |offset: u64, width: usize| -> Result<u64, ElfError> {
        let start = usize::try_from(offset).map_err(|_| ElfError::Truncated)?;
        let bytes = start
            .checked_add(width)
            .and_then(|end| elf.get(start..end))
            .ok_or(ElfError::Truncated)?;
        let mut value = 0u64;
        for i in 0..width {
            let byte = if big_endian {
                bytes[i]
            } else {
                bytes[width - 1 - i]
            };
            value = (value << 8) | u64::from(byte);
        }
        Ok(value)
    };
    // Offsets of e_phoff, e_phentsize, e_phnum, and within a program header of p_offset and
    // p_filesz, with the width of an address.
    let (phoff, phentsize, phnum, p_offset, p_filesz, word) = match elf.get(4) {
        Some(1) => (read(0x1C, 4)?, read(0x2A, 2)?, read(0x2C, 2)?, 4, 16, 4),
        Some(2) => (read(0x20, 8)?, read(0x36, 2)?, read(0x38, 2)?, 8, 32, 8),
        _ => return Err(ElfError::UnknownFormat),
    };
    for index in 0..phnum {
        let header = index
            .checked_mul(phentsize)
            .and_then(|offset| offset.checked_add(phoff))
            .ok_or(ElfError::Truncated)?;
        if read(header, 4)? != PT_INTERP {
            continue;
        }
        let offset = read(header + p_offset, word)?;
        let size = read(header + p_filesz, word)?;
        let start = usize::try_from(offset).map_err(|_| ElfError::Truncated)?;
        let end = usize::try_from(size)
            .ok()
            .and_then(|size| start.checked_add(size))
            .ok_or(ElfError::Truncated)?;
        let bytes = elf.get(start..end).ok_or(ElfError::Truncated)?;
        let path = bytes.split(|b| *b == 0).next().unwrap_or_default();
        let path = std::str::from_utf8(path).map_err(|_| ElfError::BadInterpreter)?;
        if !path.starts_with('/') || path.contains('\n') || file_name(path).is_none() {
            return Err(ElfError::BadInterpreter);
        }
        return Ok(Some(path.to_owned()));
    }
    Ok(None)
}

/// A shared library as `ldd` resolved it: the name the binary asks for, and the node's file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkedLibrary {
    pub name: String,
    pub path: PathBuf,
}

/// Why `ldd`'s output could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LddError {
    #[error("{0} => not found")]
    NotFound(String),
    #[error("unexpected line {0:?}")]
    Unparsable(String),
}

/// The libraries in the output of `ldd BINARY` (glibc's and musl's), once each:
///
/// ```text
///     linux-vdso.so.1 (0x00007ffc...)                          the kernel's: skipped
///     libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)      name => path
///     /lib64/ld-linux-x86-64.so.2 (0x...)                       a path: named by its file name
///     libfoo.so.1 => not found                                  an error
/// ```
pub fn parse_ldd(output: &str) -> Result<Vec<LinkedLibrary>, LddError> {
    let mut libraries: Vec<LinkedLibrary> = Vec::new();
    for line in output.lines().map(str::trim) {
        let without_address = |text: &str| {
            let text = format!(" {text}");
            match text.rfind(" (0x") {
                Some(at) if text.ends_with(')') => text[..at].trim().to_owned(),
                _ => text.trim().to_owned(),
            }
        };
        let library = if let Some((name, target)) = line.split_once("=>") {
            let (name, target) = (name.trim(), target.trim());
            if target.starts_with("not found") {
                return Err(LddError::NotFound(name.to_owned()));
            }
            let path = without_address(target);
            if path.is_empty() {
                continue; // an old ldd's `linux-vdso.so.1 =>  (0x...)`
            }
            if !path.starts_with('/') || file_name(name) != Some(name) {
                return Err(LddError::Unparsable(line.to_owned()));
            }
            LinkedLibrary {
                name: name.to_owned(),
                path: PathBuf::from(path),
            }
        } else if line.starts_with('/') {
            let path = without_address(line);
            let Some(name) = file_name(&path) else {
                return Err(LddError::Unparsable(line.to_owned()));
            };
            LinkedLibrary {
                name: name.to_owned(),
                path: PathBuf::from(path),
            }
        } else {
            // Blank lines, the kernel's virtual libraries, "statically linked".
            continue;
        };
        if !libraries.iter().any(|known| known.name == library.name) {
            libraries.push(library);
        }
    }
    Ok(libraries)
}

/// The last component of `path` when it is a plain file name a loader can look up.
fn file_name(path: &str) -> Option<&str> {
    let name = path.rsplit('/').next()?;
    let plain = !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(|c: char| c.is_control() || c.is_whitespace());
    plain.then_some(name)
}

/// The node's sftp server with what it needs to run in any container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftpBundle {
    pub server: Vec<u8>,
    /// The file name of the dynamic loader among `libraries`; `None` for a static server.
    pub loader: Option<String>,
    /// By the name the loader looks them up by.
    pub libraries: Vec<(String, Vec<u8>)>,
}

impl SftpBundle {
    /// The command that runs the injected server in the container.
    pub fn command(&self) -> Vec<String> {
        command_with(self.loader.as_deref())
    }

    pub fn bytes(&self) -> u64 {
        let libraries: usize = self.libraries.iter().map(|(_, bytes)| bytes.len()).sum();
        (self.server.len() + libraries) as u64
    }

    /// The archive to extract at `/`: the directories, the libraries, the server, and last
    /// the command file; everything owned by root, read-only.
    pub fn tar(&self) -> Result<Vec<u8>, InjectError> {
        let relative = |path: &str| path.trim_start_matches('/').to_owned();
        let mut builder = tar::Builder::new(Vec::new());
        let mtime = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let header = |entry_type, mode, size| {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(entry_type);
            header.set_mode(mode);
            header.set_uid(0);
            header.set_gid(0);
            header.set_size(size);
            header.set_mtime(mtime);
            header
        };
        for dir in [INJECTED_ROOT, SFTP_DIR, SFTP_LIB_DIR] {
            let mut header = header(tar::EntryType::Directory, 0o755, 0);
            builder
                .append_data(&mut header, format!("{}/", relative(dir)), std::io::empty())
                .map_err(InjectError::Tar)?;
        }
        let command = self.command().join("\n") + "\n";
        let files = self
            .libraries
            .iter()
            .map(|(name, bytes)| (format!("{SFTP_LIB_DIR}/{name}"), 0o555, bytes.as_slice()))
            .chain([
                (SFTP_SERVER.to_owned(), 0o555, self.server.as_slice()),
                (SFTP_COMMAND_FILE.to_owned(), 0o444, command.as_bytes()),
            ]);
        for (path, mode, bytes) in files {
            let mut header = header(tar::EntryType::Regular, mode, bytes.len() as u64);
            builder
                .append_data(&mut header, relative(&path), bytes)
                .map_err(InjectError::Tar)?;
        }
        builder.into_inner().map_err(InjectError::Tar)
    }
}

/// `[loader, --library-path, lib, server]`, or the server alone when it is static.
fn command_with(loader: Option<&str>) -> Vec<String> {
    match loader {
        Some(loader) => vec![
            format!("{SFTP_LIB_DIR}/{loader}"),
            "--library-path".to_owned(),
            SFTP_LIB_DIR.to_owned(),
            SFTP_SERVER.to_owned(),
        ],
        None => vec![SFTP_SERVER.to_owned()],
    }
}

/// The command in a container's [`SFTP_COMMAND_FILE`] when it is one the agent writes.
pub fn command_from_file(text: &str) -> Option<Vec<String>> {
    let lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let loader = match lines.as_slice() {
        [_] => None,
        [first, ..] => Some(file_name(
            first.strip_prefix(SFTP_LIB_DIR)?.strip_prefix('/')?,
        )?),
        [] => return None,
    };
    (command_with(loader) == lines).then_some(lines)
}

/// Finds the node's sftp server among `candidates` and reads it with its loader and libraries,
/// refusing more than `max_bytes` in all.
pub async fn host_sftp_bundle(
    candidates: &[PathBuf],
    max_bytes: u64,
) -> Result<SftpBundle, InjectError> {
    let mut found = None;
    for candidate in candidates {
        if is_executable_file(candidate).await {
            found = Some(candidate);
            break;
        }
    }
    let Some(server_path) = found else {
        let searched = candidates
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        return Err(InjectError::NoHostServer { searched });
    };
    let mut budget = Budget {
        used: 0,
        limit: max_bytes,
    };
    let server = budget.read(server_path).await?;
    let interpreter = elf_interpreter(&server).map_err(|problem| InjectError::NotElf {
        path: server_path.clone(),
        problem,
    })?;
    let Some(interpreter) = interpreter else {
        return Ok(SftpBundle {
            server,
            loader: None,
            libraries: Vec::new(),
        });
    };
    let mut linked = parse_ldd(&ldd(server_path).await?).map_err(|e| match e {
        LddError::NotFound(library) => InjectError::LibraryMissing {
            path: server_path.clone(),
            library,
        },
        other => InjectError::Ldd {
            path: server_path.clone(),
            problem: other.to_string(),
        },
    })?;
    let loader = file_name(&interpreter)
        .ok_or_else(|| InjectError::NotElf {
            path: server_path.clone(),
            problem: ElfError::BadInterpreter,
        })?
        .to_owned();
    if !linked.iter().any(|library| library.name == loader) {
        linked.push(LinkedLibrary {
            name: loader.clone(),
            path: PathBuf::from(&interpreter),
        });
    }
    let mut libraries = Vec::with_capacity(linked.len());
    for library in linked {
        libraries.push((library.name, budget.read(&library.path).await?));
    }
    Ok(SftpBundle {
        server,
        loader: Some(loader),
        libraries,
    })
}

async fn is_executable_file(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    tokio::fs::metadata(path)
        .await
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Reads files (following symbolic links) while their sizes add up to at most `limit`.
struct Budget {
    used: u64,
    limit: u64,
}

impl Budget {
    async fn read(&mut self, path: &Path) -> Result<Vec<u8>, InjectError> {
        let read_error = |source| InjectError::Read {
            path: path.to_owned(),
            source,
        };
        let size = tokio::fs::metadata(path).await.map_err(read_error)?.len();
        self.charge(size)?;
        let bytes = tokio::fs::read(path).await.map_err(read_error)?;
        // The file may have grown since its size was looked at.
        self.charge((bytes.len() as u64).saturating_sub(size))?;
        Ok(bytes)
    }

    fn charge(&mut self, bytes: u64) -> Result<(), InjectError> {
        self.used = self.used.saturating_add(bytes);
        if self.used > self.limit {
            return Err(InjectError::TooLarge {
                bytes: self.used,
                limit: self.limit,
            });
        }
        Ok(())
    }
}

/// `ldd BINARY` on the node, in the C locale.
async fn ldd(binary: &Path) -> Result<String, InjectError> {
    let ldd_error = |problem: String| InjectError::Ldd {
        path: binary.to_owned(),
        problem,
    };
    let run = tokio::process::Command::new("ldd")
        .arg(binary)
        .env("LC_ALL", "C")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(LDD_TIMEOUT, run)
        .await
        .map_err(|_| ldd_error(format!("no answer within {} s", LDD_TIMEOUT.as_secs())))?
        .map_err(|e| ldd_error(format!("{e} (ldd comes with the C library: libc-bin)")))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(ldd_error(format!(
            "{}: {}",
            output.status,
            format!("{stdout} {stderr}").trim()
        )));
    }
    Ok(stdout)
}

/// Lends the node's sftp server to containers whose image has none: uploads it once per
/// container, while other streams of the same container wait (one lock per container), and
/// answers the command that runs it.
#[derive(Debug)]
pub struct SftpInjector {
    host_paths: Vec<PathBuf>,
    max_bytes: u64,
    locks: Mutex<HashMap<String, Weak<tokio::sync::Mutex<()>>>>,
}

impl Default for SftpInjector {
    fn default() -> Self {
        Self::new(
            SFTP_SERVER_PATHS.iter().map(PathBuf::from).collect(),
            MAX_BUNDLE_BYTES,
        )
    }
}

impl SftpInjector {
    /// An injector taking the node's server from the first of `host_paths` that exists.
    pub fn new(host_paths: Vec<PathBuf>, max_bytes: u64) -> Self {
        Self {
            host_paths,
            max_bytes,
            locks: Mutex::default(),
        }
    }

    /// The command that runs the injected server in `container_id`, uploading it first when
    /// the container does not have it yet.
    pub async fn command(
        &self,
        runtime: &dyn ContainerRuntime,
        container_id: &str,
    ) -> Result<Vec<String>, InjectError> {
        let lock = self.lock_of(container_id);
        let _only_one_upload = lock.lock().await;
        if let Some(command) = installed_command(runtime, container_id).await? {
            return Ok(command);
        }
        let bundle = host_sftp_bundle(&self.host_paths, self.max_bytes).await?;
        runtime
            .upload_archive(container_id, "/", bundle.tar()?)
            .await?;
        info!(container = %container_id, bytes = bundle.bytes(), files = bundle.libraries.len() + 1,
              "Lent the node's sftp-server to a container whose image has none.");
        Ok(bundle.command())
    }

    fn lock_of(&self, container_id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
        locks.retain(|_, lock| lock.strong_count() > 0);
        if let Some(lock) = locks.get(container_id).and_then(Weak::upgrade) {
            return lock;
        }
        let lock = Arc::new(tokio::sync::Mutex::new(()));
        locks.insert(container_id.to_owned(), Arc::downgrade(&lock));
        lock
    }
}

/// The command of a bundle already in the container; `None` when there is none (or one the
/// agent did not write, which is then replaced).
async fn installed_command(
    runtime: &dyn ContainerRuntime,
    container_id: &str,
) -> Result<Option<Vec<String>>, InjectError> {
    let Some(archive) = runtime
        .download_archive(container_id, SFTP_COMMAND_FILE)
        .await?
    else {
        return Ok(None);
    };
    let command = accounts::file_from_tar(&archive, SFTP_COMMAND_FILE)
        .map_err(|e| error_chain(&e))
        .and_then(|file| {
            command_from_file(&file.text).ok_or_else(|| "not a command ongrid writes".to_owned())
        });
    match command {
        Ok(command) => Ok(Some(command)),
        Err(problem) => {
            warn!(container = %container_id, %problem, "Replacing the injected sftp server's command file.");
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GLIBC_LDD: &str = "\tlinux-vdso.so.1 (0x00007ffd4b7e2000)
\tlibcrypto.so.3 => /lib/x86_64-linux-gnu/libcrypto.so.3 (0x00007f2b6c200000)
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2b6c01f000)
\tlibz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x00007f2b6c7d0000)
\t/lib64/ld-linux-x86-64.so.2 (0x00007f2b6c83b000)
";

    const MUSL_LDD: &str = "\t/lib/ld-musl-x86_64.so.1 (0x7f0d4a4a9000)
\tlibc.musl-x86_64.so.1 => /lib/ld-musl-x86_64.so.1 (0x7f0d4a4a9000)
";

    fn library(name: &str, path: &str) -> LinkedLibrary {
        LinkedLibrary {
            name: name.into(),
            path: path.into(),
        }
    }

    #[test]
    fn glibc_ldd_gives_each_library_by_the_name_it_is_asked_for() {
        assert_eq!(
            parse_ldd(GLIBC_LDD).unwrap(),
            [
                library("libcrypto.so.3", "/lib/x86_64-linux-gnu/libcrypto.so.3"),
                library("libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6"),
                library("libz.so.1", "/lib/x86_64-linux-gnu/libz.so.1"),
                library("ld-linux-x86-64.so.2", "/lib64/ld-linux-x86-64.so.2"),
            ]
        );
    }

    #[test]
    fn musl_ldd_and_old_vdso_lines_are_understood() {
        assert_eq!(
            parse_ldd(MUSL_LDD).unwrap(),
            [
                library("ld-musl-x86_64.so.1", "/lib/ld-musl-x86_64.so.1"),
                library("libc.musl-x86_64.so.1", "/lib/ld-musl-x86_64.so.1"),
            ]
        );
        let old = "\tlinux-gate.so.1 =>  (0xb7f0c000)\n\tlibc.so.6 => /lib/libc.so.6 (0xb7d8b000)\n\t/lib/ld-linux.so.2 (0xb7f0d000)\n";
        assert_eq!(
            parse_ldd(old).unwrap(),
            [
                library("libc.so.6", "/lib/libc.so.6"),
                library("ld-linux.so.2", "/lib/ld-linux.so.2"),
            ]
        );
        assert_eq!(parse_ldd("\tstatically linked\n").unwrap(), []);
    }

    #[test]
    fn a_missing_library_or_a_strange_line_is_an_error() {
        let missing = format!("{GLIBC_LDD}\tlibfido2.so.1 => not found\n");
        assert_eq!(
            parse_ldd(&missing),
            Err(LddError::NotFound("libfido2.so.1".into()))
        );
        assert!(matches!(
            parse_ldd("\tlibc.so.6 => relative/libc.so.6 (0x1)\n"),
            Err(LddError::Unparsable(_))
        ));
        assert!(matches!(
            parse_ldd("\t../x => /lib/x (0x1)\n"),
            Err(LddError::Unparsable(_))
        ));
    }

    /// A minimal ELF file: the header, one `PT_LOAD` and optionally one `PT_INTERP` header,
    /// then the interpreter's path.
    fn elf(class64: bool, big_endian: bool, interpreter: Option<&[u8]>) -> Vec<u8> {
        let put = |out: &mut Vec<u8>, value: u64, width: usize| {
            let bytes = value.to_be_bytes();
            let mut field = bytes[8 - width..].to_vec();
            if !big_endian {
                field.reverse();
            }
            out.extend(field);
        };
        let (ehsize, phentsize) = if class64 { (64, 56) } else { (52, 32) };
        let word = if class64 { 8 } else { 4 };
        let phnum = if interpreter.is_some() { 2 } else { 1 };
        let path_offset = (ehsize + phentsize * phnum) as u64;
        let mut out = b"\x7fELF".to_vec();
        out.extend([
            if class64 { 2 } else { 1 },
            if big_endian { 2 } else { 1 },
            1,
        ]);
        out.resize(16, 0);
        put(&mut out, 2, 2); // e_type: EXEC
        put(&mut out, 62, 2); // e_machine
        put(&mut out, 1, 4); // e_version
        put(&mut out, 0x401000, word); // e_entry
        put(&mut out, ehsize as u64, word); // e_phoff
        put(&mut out, 0, word); // e_shoff
        put(&mut out, 0, 4); // e_flags
        put(&mut out, ehsize as u64, 2);
        put(&mut out, phentsize as u64, 2);
        put(&mut out, phnum as u64, 2);
        put(&mut out, 0, 2); // e_shentsize
        put(&mut out, 0, 2); // e_shnum
        put(&mut out, 0, 2); // e_shstrndx
        assert_eq!(out.len(), ehsize);
        let program_header = |out: &mut Vec<u8>, p_type: u64, offset: u64, size: u64| {
            let start = out.len();
            put(out, p_type, 4);
            if class64 {
                put(out, 4, 4); // p_flags
            }
            put(out, offset, word);
            put(out, 0, word); // p_vaddr
            put(out, 0, word); // p_paddr
            put(out, size, word); // p_filesz
            put(out, size, word); // p_memsz
            if !class64 {
                put(out, 4, 4); // p_flags
            }
            put(out, 1, word); // p_align
            assert_eq!(out.len() - start, phentsize);
        };
        program_header(&mut out, 1, 0, path_offset);
        if let Some(path) = interpreter {
            program_header(&mut out, 3, path_offset, path.len() as u64 + 1);
            out.extend(path);
            out.push(0);
        }
        out
    }

    #[test]
    fn the_interpreter_is_read_from_every_kind_of_elf() {
        for class64 in [false, true] {
            for big_endian in [false, true] {
                let with = elf(class64, big_endian, Some(b"/lib/ld-linux.so.2"));
                assert_eq!(
                    elf_interpreter(&with),
                    Ok(Some("/lib/ld-linux.so.2".to_owned())),
                    "64-bit {class64}, big-endian {big_endian}"
                );
                assert_eq!(elf_interpreter(&elf(class64, big_endian, None)), Ok(None));
                let cut = &with[..with.len() - 5];
                assert_eq!(elf_interpreter(cut), Err(ElfError::Truncated));
            }
        }
        assert_eq!(elf_interpreter(b"#!/bin/sh\n"), Err(ElfError::NotElf));
        assert_eq!(
            elf_interpreter(&elf(true, false, Some(b"ld.so"))),
            Err(ElfError::BadInterpreter),
            "not an absolute path"
        );
        assert_eq!(
            elf_interpreter(&elf(true, false, Some(b"/lib/\xff"))),
            Err(ElfError::BadInterpreter)
        );
    }

    #[test]
    fn the_interpreter_of_a_real_program_is_the_loader_ldd_names() {
        let program = std::fs::read("/bin/sh").unwrap();
        let interpreter = elf_interpreter(&program).unwrap().unwrap();
        assert!(interpreter.contains("/ld-"), "{interpreter}");
        assert!(Path::new(&interpreter).exists(), "{interpreter}");
    }

    proptest! {
        #[test]
        fn elf_parsing_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = elf_interpreter(&bytes);
            let mut elf = b"\x7fELF\x02\x01".to_vec();
            elf.extend(&bytes);
            let _ = elf_interpreter(&elf);
        }

        #[test]
        fn ldd_parsing_never_panics(text in "[ -~\t\n=>()/]{0,300}") {
            let _ = parse_ldd(&text);
        }
    }

    #[test]
    fn the_command_file_is_only_trusted_in_the_forms_ongrid_writes() {
        let dynamic = command_with(Some("ld-linux-x86-64.so.2"));
        assert_eq!(
            dynamic,
            [
                "/run/ongrid/sftp/lib/ld-linux-x86-64.so.2",
                "--library-path",
                "/run/ongrid/sftp/lib",
                "/run/ongrid/sftp/sftp-server"
            ]
        );
        let text = dynamic.join("\n") + "\n";
        assert_eq!(command_from_file(&text), Some(dynamic));
        assert_eq!(
            command_from_file("/run/ongrid/sftp/sftp-server\n"),
            Some(vec![SFTP_SERVER.to_owned()])
        );
        for bad in [
            "",
            "/bin/sh\n",
            "/run/ongrid/sftp/lib/../../../bin/sh\n--library-path\n/run/ongrid/sftp/lib\n/run/ongrid/sftp/sftp-server\n",
            "/run/ongrid/sftp/lib/ld.so\n--library-path\n/tmp\n/run/ongrid/sftp/sftp-server\n",
            "/run/ongrid/sftp/lib/ld.so\n/run/ongrid/sftp/sftp-server\n",
        ] {
            assert_eq!(command_from_file(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_archive_is_read_only_root_owned_and_ends_with_the_command() {
        let bundle = SftpBundle {
            server: b"server".to_vec(),
            loader: Some("ld.so.2".into()),
            libraries: vec![
                ("libc.so.6".into(), b"libc".to_vec()),
                ("ld.so.2".into(), b"loader".to_vec()),
            ],
        };
        assert_eq!(bundle.bytes(), 16);
        let archive = bundle.tar().unwrap();
        let mut entries = Vec::new();
        for entry in tar::Archive::new(archive.as_slice()).entries().unwrap() {
            let entry = entry.unwrap();
            let header = entry.header();
            assert_eq!((header.uid().unwrap(), header.gid().unwrap()), (0, 0));
            entries.push((
                entry.path().unwrap().display().to_string(),
                header.mode().unwrap(),
            ));
        }
        assert_eq!(
            entries,
            [
                ("run/ongrid/".to_owned(), 0o755),
                ("run/ongrid/sftp/".to_owned(), 0o755),
                ("run/ongrid/sftp/lib/".to_owned(), 0o755),
                ("run/ongrid/sftp/lib/libc.so.6".to_owned(), 0o555),
                ("run/ongrid/sftp/lib/ld.so.2".to_owned(), 0o555),
                ("run/ongrid/sftp/sftp-server".to_owned(), 0o555),
                ("run/ongrid/sftp/command".to_owned(), 0o444),
            ]
        );
        let mut text = String::new();
        for entry in tar::Archive::new(archive.as_slice()).entries().unwrap() {
            let mut entry = entry.unwrap();
            if entry.path().unwrap().ends_with("command") {
                std::io::Read::read_to_string(&mut entry, &mut text).unwrap();
            }
        }
        assert_eq!(command_from_file(&text), Some(bundle.command()));
    }

    #[tokio::test]
    async fn a_node_program_is_bundled_with_its_loader_and_libraries() {
        // Any dynamically linked program of the node takes the same path as its sftp-server.
        let bundle = host_sftp_bundle(
            &["/nonexistent/sftp-server".into(), "/bin/true".into()],
            MAX_BUNDLE_BYTES,
        )
        .await
        .unwrap();
        assert_eq!(bundle.server, std::fs::read("/bin/true").unwrap());
        let loader = bundle.loader.clone().unwrap();
        let names: Vec<&str> = bundle.libraries.iter().map(|(n, _)| n.as_str()).collect();
        assert!(names.contains(&loader.as_str()), "{names:?}");
        assert!(names.iter().any(|n| n.starts_with("libc.")), "{names:?}");
        for (name, bytes) in &bundle.libraries {
            assert!(bytes.starts_with(b"\x7fELF"), "{name} is an ELF file");
        }

        let err = host_sftp_bundle(&["/bin/true".into()], 1024)
            .await
            .unwrap_err();
        assert!(
            matches!(err, InjectError::TooLarge { limit: 1024, .. }),
            "{err:?}"
        );
        let err = host_sftp_bundle(
            &["/nonexistent/a".into(), "/nonexistent/b".into()],
            MAX_BUNDLE_BYTES,
        )
        .await
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "this node has no sftp-server either (looked for /nonexistent/a, /nonexistent/b): \
             install openssh-sftp-server on the node"
        );
    }
}
