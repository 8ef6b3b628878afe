//! The squashfs writer: `tar2sqfs` (squashfs-tools-ng) reading the filtered tar on its stdin.
//! It keeps ownership, modes (setuid included), hard links, symlinks, devices and extended
//! attributes, compresses blocks on several threads and writes the image with mksquashfs'
//! defaults (128 KiB blocks, 4 KiB device padding), except gzip's level ([`GZIP_LEVEL`]).

use std::io::{self, Read};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;

use ongrid_core::image::Compression;

/// Bytes of tar2sqfs' stderr kept for the error message (the end of it).
const STDERR_KEEP: usize = 8 * 1024;
/// Pipe buffer towards tar2sqfs (Linux allows up to 1 MiB without privileges).
const PIPE_BUFFER: i32 = 1024 * 1024;

pub(crate) const TOOL: &str = "tar2sqfs";

/// zlib's own default level, where squashfs tools default to 9. Measured on 372 MiB of Debian's
/// `/usr` (text, Python, locales) with `tar2sqfs -j 2`: level 9 took 28.8 s of CPU, level 6
/// 13.0 s, for an image 0.4% larger. Compression is most of a freeze's time, and a frozen image is
/// read far more often than it is written, but a few tenths of a percent of size do not pay for
/// twice the wait. Every reader (the kernel, squashfuse, `unsquashfs`) decodes either level.
const GZIP_LEVEL: u32 = 6;

/// A running `tar2sqfs`; killed and reaped on drop unless [`Packer::wait`] ran.
pub(crate) struct Packer {
    child: Option<Child>,
    stderr: Option<JoinHandle<Vec<u8>>>,
}

/// Why tar2sqfs did not produce an image.
#[derive(Debug)]
pub(crate) enum PackError {
    /// The binary is not installed.
    Missing,
    /// Spawning or waiting failed.
    Io(io::Error),
    /// It exited unsuccessfully; the end of its stderr.
    Failed { status: ExitStatus, stderr: String },
}

impl Packer {
    /// Starts `tar2sqfs` writing `output`; returns it and the pipe to write the tar into.
    pub fn spawn(
        output: &Path,
        compression: Compression,
        jobs: usize,
        mtime: u64,
    ) -> Result<(Packer, ChildStdin), PackError> {
        let mut command = Command::new(TOOL);
        match compression {
            Compression::Gzip => command
                .args(["--compressor", "gzip"])
                .args(["--comp-extra", &format!("level={GZIP_LEVEL}")]),
            Compression::Zstd => command.args(["--compressor", "zstd"]),
        };
        let mut child = command
            .arg("--quiet")
            .arg("--no-skip")
            .arg("--force")
            .args(["--num-jobs", &jobs.max(1).to_string()])
            // The root and any directory the tar implies without an entry.
            .args([
                "--defaults",
                &format!("uid=0,gid=0,mode=0755,mtime={mtime}"),
            ])
            .arg(output)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => PackError::Missing,
                _ => PackError::Io(e),
            })?;
        let stdin = child.stdin.take();
        let stderr = child.stderr.take();
        let mut packer = Packer {
            child: Some(child),
            stderr: stderr.map(|mut stderr| {
                std::thread::spawn(move || {
                    let mut kept = Vec::new();
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = stderr.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        kept.extend_from_slice(&buf[..n]);
                        if kept.len() > 2 * STDERR_KEEP {
                            kept.drain(..kept.len() - STDERR_KEEP);
                        }
                    }
                    kept
                })
            }),
        };
        let Some(stdin) = stdin else {
            packer.kill();
            return Err(PackError::Io(io::Error::other(
                "tar2sqfs has no stdin pipe",
            )));
        };
        // A larger pipe means fewer context switches between us and tar2sqfs; best effort.
        let _ = nix::fcntl::fcntl(&stdin, nix::fcntl::FcntlArg::F_SETPIPE_SZ(PIPE_BUFFER));
        Ok((packer, stdin))
    }

    /// Waits for tar2sqfs to exit (its stdin must be closed by now).
    pub fn wait(mut self) -> Result<(), PackError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let status = child.wait().map_err(PackError::Io)?;
        let stderr = self
            .stderr
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        if status.success() {
            return Ok(());
        }
        let text = String::from_utf8_lossy(&stderr);
        let tail: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let tail = tail[tail.len().saturating_sub(5)..].join("; ");
        Err(PackError::Failed {
            status,
            stderr: tail,
        })
    }

    /// Stops tar2sqfs (cancel, bad input) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(handle) = self.stderr.take() {
            let _ = handle.join();
        }
    }
}

impl Drop for Packer {
    fn drop(&mut self) {
        self.kill();
    }
}
