//! What the `nvidia-smi` backend reads besides the inventory to judge a GPU's health: the lines
//! in which nvidia-smi says it cannot reach a GPU ([`take_problems`]), and the Xid errors the
//! NVIDIA driver writes to the kernel log ([`KernelLog`]).
//!
//! A GPU is named by its PCI address in both ([`PciAddress`]): nvidia-smi prints
//! `Unable to determine the device handle for GPU 0000:3B:00.0: Unknown Error`, the driver
//! `NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.`. Only Xids that mean
//! the hardware is in trouble ([`FATAL_XIDS`]) fail a GPU; the others (13, 31, 43, 45: a
//! program's own fault) are left to the program.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{ErrorKind, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use chrono::Utc;
use tracing::{info, warn};

/// Xid errors that take a GPU out of service, with what they mean (NVIDIA's Xid catalogue).
pub const FATAL_XIDS: [(u32, &str); 12] = [
    (48, "double-bit ECC error"),
    (61, "internal micro-controller breakpoint"),
    (62, "internal micro-controller halt"),
    (63, "ECC page retirement or row remapping event"),
    (64, "ECC page retirement or row remapping failure"),
    (74, "NVLink error"),
    (79, "GPU has fallen off the bus"),
    (92, "high single-bit ECC error rate"),
    (94, "contained ECC error"),
    (95, "uncontained ECC error"),
    (119, "GSP RPC timeout"),
    (120, "GSP error"),
];

/// A PCI address as domain, bus and device; the function is left out (a GPU is function 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    domain: u32,
    bus: u8,
    device: u8,
}

impl PciAddress {
    /// `00000000:3B:00.0` (nvidia-smi's `pci.bus_id`), `0000:3b:00.0` or `0000:3b:00` (the
    /// kernel log's), case-insensitive.
    pub fn parse(text: &str) -> Option<Self> {
        let text = text.trim();
        let without_function = match text.rsplit_once('.') {
            Some((address, function)) if function.bytes().all(|b| b.is_ascii_hexdigit()) => address,
            _ => text,
        };
        let mut parts = without_function.split(':');
        let (domain, bus, device) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || domain.len() > 8 || bus.len() > 2 || device.len() > 2 {
            return None;
        }
        Some(Self {
            domain: u32::from_str_radix(domain, 16).ok()?,
            bus: u8::from_str_radix(bus, 16).ok()?,
            device: u8::from_str_radix(device, 16).ok()?,
        })
    }
}

/// A line in which nvidia-smi says it cannot reach a GPU, and which GPU, when it says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub gpu: Option<PciAddress>,
    pub line: String,
}

/// Whether nvidia-smi says in this line that it cannot reach a GPU.
fn is_problem(line: &str) -> bool {
    let lower = line.to_ascii_lowercase();
    lower.contains("unable to determine the device handle")
        || lower.contains("gpu is lost")
        || lower.contains("fallen off the bus")
}

/// The PCI address named in a problem line (`... for GPU 0000:3B:00.0: ...`).
fn address_in(line: &str) -> Option<PciAddress> {
    line.split(|c: char| c.is_whitespace() || c == '(' || c == ')' || c == ',')
        .map(|word| word.trim_end_matches(':'))
        .find_map(|word| (word.matches(':').count() == 2).then(|| PciAddress::parse(word))?)
}

/// Takes the problem lines out of `text`, leaving the rest as it was.
pub fn take_problems(text: &mut String) -> Vec<Problem> {
    if !text.lines().any(is_problem) {
        return Vec::new();
    }
    let mut problems = Vec::new();
    let mut rest = String::with_capacity(text.len());
    for line in text.lines() {
        if is_problem(line) {
            problems.push(Problem {
                gpu: address_in(line),
                line: line.trim().to_owned(),
            });
        } else {
            rest.push_str(line);
            rest.push('\n');
        }
    }
    *text = rest;
    problems
}

/// An Xid error as the driver logged it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Xid {
    pub gpu: PciAddress,
    pub code: u32,
    /// What it means, from [`FATAL_XIDS`], or the driver's own words for other codes.
    pub meaning: String,
}

/// The Xid in one kernel log line, if any: `NVRM: Xid (PCI:0000:3b:00): 79, pid=..., text`.
pub fn parse_xid(line: &str) -> Option<Xid> {
    let rest = &line[line.find("NVRM: Xid (PCI:")? + "NVRM: Xid (PCI:".len()..];
    let (address, rest) = rest.split_once(')')?;
    let gpu = PciAddress::parse(address)?;
    let rest = rest.trim_start_matches(':').trim_start();
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let code: u32 = rest[..digits].parse().ok()?;
    let meaning = FATAL_XIDS
        .iter()
        .find(|(fatal, _)| *fatal == code)
        .map(|(_, meaning)| (*meaning).to_owned())
        .unwrap_or_else(|| {
            rest.rsplit(", ")
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned()
        });
    Some(Xid { gpu, code, meaning })
}

/// Whether an Xid takes its GPU out of service.
pub fn is_fatal(code: u32) -> bool {
    FATAL_XIDS.iter().any(|(fatal, _)| *fatal == code)
}

/// The kernel log (`/dev/kmsg`, or a file in tests), read where permitted: each discovery reads
/// what was added since the last one, without blocking. GPUs with a fatal Xid stay failed for
/// as long as the agent runs (the manager keeps them drained until an admin undrains them).
#[derive(Debug)]
pub struct KernelLog {
    path: PathBuf,
    state: Mutex<LogState>,
}

#[derive(Debug, Default)]
struct LogState {
    file: Option<File>,
    /// Not readable (no permission, not there): said once, not tried again.
    off: bool,
    /// An unfinished last line, completed by the next read.
    partial: String,
    failed: BTreeMap<PciAddress, String>,
}

impl KernelLog {
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            state: Mutex::new(LogState::default()),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads what the log gained since the last call; returns every GPU with a fatal Xid seen
    /// so far and why (`Xid 79 at 2026-11-25 10:00:00 UTC: GPU has fallen off the bus`).
    pub fn failed_gpus(&self) -> BTreeMap<PciAddress, String> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if !state.off {
            for line in self.read_new(&mut state) {
                let Some(xid) = parse_xid(&line) else {
                    continue;
                };
                if !is_fatal(xid.code) {
                    info!(code = xid.code, meaning = %xid.meaning, "Xid in the kernel log; not a GPU failure.");
                    continue;
                }
                let reason = format!(
                    "Xid {} at {}: {}",
                    xid.code,
                    Utc::now().format("%Y-%m-%d %H:%M:%S UTC"),
                    xid.meaning
                );
                warn!(gpu = ?xid.gpu, %reason, "Fatal Xid in the kernel log.");
                state.failed.entry(xid.gpu).or_insert(reason);
            }
        }
        state.failed.clone()
    }

    /// The complete lines added since the last read.
    fn read_new(&self, state: &mut LogState) -> Vec<String> {
        if state.file.is_none() {
            match std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits())
                .open(&self.path)
            {
                Ok(file) => state.file = Some(file),
                Err(error) => {
                    info!(path = %self.path.display(), %error, "Kernel log not readable; Xid errors are not watched.");
                    state.off = true;
                    return Vec::new();
                }
            }
        }
        let mut bytes = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        if let Some(file) = state.file.as_mut() {
            loop {
                match file.read(&mut chunk) {
                    Ok(0) => break,
                    Ok(n) => bytes.extend_from_slice(&chunk[..n]),
                    Err(error) if error.kind() == ErrorKind::WouldBlock => break,
                    // /dev/kmsg: records were overwritten before they were read; go on.
                    Err(error) if error.raw_os_error() == Some(nix::libc::EPIPE) => {}
                    Err(error) if error.kind() == ErrorKind::Interrupted => {}
                    Err(error) => {
                        warn!(path = %self.path.display(), %error, "Cannot read the kernel log; Xid errors are not watched.");
                        state.off = true;
                        break;
                    }
                }
            }
        }
        let mut text = std::mem::take(&mut state.partial);
        text.push_str(&String::from_utf8_lossy(&bytes));
        let complete = text.rfind('\n').map_or(0, |end| end + 1);
        state.partial = text[complete..].to_owned();
        text[..complete].lines().map(str::to_owned).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn pci_addresses_of_nvidia_smi_and_the_kernel_log_agree() {
        let smi = PciAddress::parse("00000000:3B:00.0").unwrap();
        assert_eq!(PciAddress::parse("0000:3b:00"), Some(smi));
        assert_eq!(PciAddress::parse("0000:3b:00.0"), Some(smi));
        assert_ne!(PciAddress::parse("0000:3c:00"), Some(smi));
        assert_eq!(PciAddress::parse("3b:00"), None);
        assert_eq!(PciAddress::parse("[N/A]"), None);
    }

    #[test]
    fn problem_lines_are_taken_out_with_their_gpu() {
        let mut text =
            "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-08148167-439d-189d-b2e3-62da23b5f7b1)\n\
             Unable to determine the device handle for GPU 0000:3B:00.0: Unknown Error\n"
                .to_owned();
        let problems = take_problems(&mut text);
        assert_eq!(
            problems,
            [Problem {
                gpu: PciAddress::parse("0000:3b:00"),
                line: "Unable to determine the device handle for GPU 0000:3B:00.0: Unknown Error"
                    .to_owned()
            }]
        );
        assert_eq!(
            text,
            "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-08148167-439d-189d-b2e3-62da23b5f7b1)\n"
        );
        let mut lost = "GPU is lost\n".to_owned();
        assert_eq!(take_problems(&mut lost)[0].gpu, None);
        let mut fine = "a, b\n".to_owned();
        assert!(take_problems(&mut fine).is_empty());
        assert_eq!(fine, "a, b\n");
    }

    #[test]
    fn xids_name_their_gpu_and_only_hardware_ones_are_fatal() {
        let xid = parse_xid(
            "6,1234,5678,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=0, name=python, GPU has fallen off the bus.",
        )
        .unwrap();
        assert_eq!(xid.gpu, PciAddress::parse("0000:3b:00").unwrap());
        assert_eq!(xid.code, 79);
        assert_eq!(xid.meaning, "GPU has fallen off the bus");
        assert!(is_fatal(79));
        let app =
            parse_xid("NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=a.out, Graphics Exception")
                .unwrap();
        assert!(!is_fatal(app.code));
        assert_eq!(parse_xid("usb 1-1: new device"), None);
    }

    #[test]
    fn the_log_is_read_as_it_grows_and_fatal_xids_stay() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kmsg");
        std::fs::write(&path, "boot\n").unwrap();
        let log = KernelLog::new(path.clone());
        assert!(log.failed_gpus().is_empty());
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        write!(
            file,
            "NVRM: Xid (PCI:0000:3b:00): 13, pid=1, x\nNVRM: Xid (PCI:0000:3b:00): 7"
        )
        .unwrap();
        assert!(
            log.failed_gpus().is_empty(),
            "an app's Xid, and half a line"
        );
        writeln!(file, "9, pid=1, name=x, GPU has fallen off the bus.").unwrap();
        let failed = log.failed_gpus();
        let reason = &failed[&PciAddress::parse("0000:3b:00").unwrap()];
        assert!(reason.starts_with("Xid 79 at "), "{reason}");
        assert!(reason.ends_with(": GPU has fallen off the bus"), "{reason}");
        assert_eq!(log.failed_gpus(), failed, "it stays");

        let missing = KernelLog::new(dir.path().join("none"));
        assert!(missing.failed_gpus().is_empty());
    }
}
