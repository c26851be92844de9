//! The RDMA probe and transport selection (docs/ARCHITECTURE.md, "Transports"): which verbs
//! devices this host has, their port states and network devices, which
//! interface RDMA would use, whether rdma_cm resolves its address — and so
//! whether `auto` picks RDMA or TCP, and why. `kvsync probe` prints it; the
//! agent decides with it once at start, and [`LocalRdma`] keeps that
//! finding true while the device goes away and comes back.
//!
//! Owns the device listing through libibverbs (`ibv_get_device_list`: a NULL
//! list with ENOSYS means the kernel has no RDMA stack), soft-device
//! detection (`rxe*`, `siw*`) and the choice of device. Built without the
//! `rdma` feature it reports that instead of probing. With the emulated
//! provider it says plainly that the fabric is an emulation.

use std::net::IpAddr;

use serde::Serialize;

use super::fabric::FabricError;
use super::select::{self, Iface};
use super::TransportKind;
use crate::blk3::BulkParams;
use crate::config::{RdmaProvider, TransportConfig, TransportMode};

/// One port of a device.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct PortInfo {
    pub port: u8,
    pub state: String,
    pub active: bool,
    pub link_layer: String,
    /// The network device this port is bound to (RoCE), if known.
    pub netdev: Option<String>,
}

/// One verbs device.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct DeviceInfo {
    pub name: String,
    /// Software device (soft-RoCE `rxe*` or soft-iWARP `siw*`).
    pub soft: bool,
    pub ports: Vec<PortInfo>,
}

/// What the probe found and what the agent will do with it.
#[derive(Debug, Clone, Serialize)]
pub struct Probe {
    /// RDMA is usable: an ACTIVE device port whose address resolves (or the
    /// emulated fabric is configured).
    pub rdma_available: bool,
    /// Why RDMA is or is not available, for humans.
    pub reason: String,
    pub devices: Vec<DeviceInfo>,
    /// The device RDMA would use.
    pub device: Option<String>,
    /// That device is a software device (runtime caps apply).
    pub soft: bool,
    /// The configured RDMA implementation.
    pub provider: RdmaProvider,
    /// The interface and local address RDMA binds and connects from.
    pub interface: Option<String>,
    pub local_addr: Option<IpAddr>,
    /// The configured `transport.mode`.
    pub mode: TransportMode,
    /// What a sync started with the configured mode uses.
    pub choice: TransportKind,
    /// Bulk parameters in effect (after soft-device caps).
    pub chunk_mb: u64,
    pub pipeline: u32,
    pub signal_batch: u32,
}

/// The probe's finding as the agent runs: an RDMA device can go away under
/// a running agent (hot-unplug, `rdma link delete`) and come back. The RDMA
/// listener notes both; offers, syncs and status read it here.
#[derive(Debug)]
pub struct LocalRdma {
    probe: Probe,
    /// Why RDMA is not usable now although the probe found it.
    lost: std::sync::Mutex<Option<String>>,
}

impl LocalRdma {
    pub fn new(probe: Probe) -> LocalRdma {
        LocalRdma {
            probe,
            lost: std::sync::Mutex::new(None),
        }
    }

    /// What the probe found at start (device, interface, provider, caps).
    pub fn probe(&self) -> &Probe {
        &self.probe
    }

    /// RDMA is usable now.
    pub fn available(&self) -> bool {
        self.probe.rdma_available && self.lost_reason().is_none()
    }

    /// Why RDMA is or is not usable now, for humans.
    pub fn reason(&self) -> String {
        self.lost_reason()
            .unwrap_or_else(|| self.probe.reason.clone())
    }

    fn lost_reason(&self) -> Option<String> {
        self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The device is gone (`Some(why)`) or back (`None`).
    pub fn set_lost(&self, why: Option<String>) {
        *self.lost.lock().unwrap_or_else(|p| p.into_inner()) = why;
    }
}

impl Probe {
    /// RDMA turned out unusable after the probe (its listener could not
    /// start): this agent uses TCP, and says why.
    pub fn fall_back_to_tcp(&mut self, reason: String) {
        self.rdma_available = false;
        self.choice = TransportKind::Tcp;
        self.reason = reason;
    }

    /// Bulk parameters for RDMA sessions: the configuration, capped on soft
    /// devices.
    pub fn bulk_params(t: &TransportConfig, soft: bool) -> BulkParams {
        let p = BulkParams::new(t.chunk_mb, t.pipeline, t.signal_batch);
        if soft {
            p.capped_for_soft()
        } else {
            p
        }
    }
}

/// True for software RDMA devices, which get the runtime caps of docs/ARCHITECTURE.md, "BLK3".
pub fn is_soft(name: &str) -> bool {
    name.starts_with("rxe") || name.starts_with("siw")
}

/// Probes the host for an agent's configuration: as [`probe`], and RDMA,
/// which has no TLS, is not used where the data plane must be encrypted
/// (`[data] tls = "required"`) unless `rdma_unencrypted_ok` says the fabric
/// is trusted.
pub fn probe_agent(c: &crate::config::Config) -> Probe {
    let mut p = probe(&c.transport);
    if p.rdma_available && !c.rdma_allowed_unencrypted() {
        p.fall_back_to_tcp(format!(
            "{}; not used: [data] tls = \"required\" and RDMA has no TLS (set [transport] rdma_unencrypted_ok = true on a trusted fabric)",
            p.reason
        ));
    }
    p
}

/// Probes the host for the transport configuration `t`.
pub fn probe(t: &TransportConfig) -> Probe {
    let ifaces = select::interfaces();
    let found = match (t.mode, t.rdma_provider) {
        (TransportMode::Tcp, _) => Found::none("transport.mode = \"tcp\": RDMA is not probed"),
        (_, RdmaProvider::Emulated) => {
            let local = select::choose(&ifaces, &t.interface, None);
            Found {
                available: true,
                reason: "emulated RDMA fabric: a userspace emulation of RC queue pairs over TCP (not hardware, not a fast path)".into(),
                devices: Vec::new(),
                device: None,
                soft: false,
                local_addr: Some(local.as_ref().map_or(IpAddr::from([127, 0, 0, 1]), |i| i.ip)),
                interface: Some(local.map_or("lo".into(), |i| i.name)),
            }
        }
        (_, RdmaProvider::Verbs) => match list_devices() {
            Err(reason) => Found::none(&reason.to_string()),
            Ok(devices) => decide(devices, &ifaces, &t.interface, resolve),
        },
    };
    let params = Probe::bulk_params(t, found.soft);
    Probe {
        rdma_available: found.available,
        reason: found.reason,
        devices: found.devices,
        device: found.device,
        soft: found.soft,
        provider: t.rdma_provider,
        interface: found.interface,
        local_addr: found.local_addr,
        mode: t.mode,
        choice: if found.available {
            TransportKind::Rdma
        } else {
            TransportKind::Tcp
        },
        chunk_mb: params.chunk >> 20,
        pipeline: params.pipeline,
        signal_batch: params.signal_batch,
    }
}

/// The verbs-specific part of a probe.
struct Found {
    available: bool,
    reason: String,
    devices: Vec<DeviceInfo>,
    device: Option<String>,
    soft: bool,
    interface: Option<String>,
    local_addr: Option<IpAddr>,
}

impl Found {
    fn none(reason: &str) -> Found {
        Found {
            available: false,
            reason: reason.into(),
            devices: Vec::new(),
            device: None,
            soft: false,
            interface: None,
            local_addr: None,
        }
    }
}

/// rdma_cm's address resolution on the local address: the device it binds.
#[cfg(feature = "rdma")]
fn resolve(ip: IpAddr) -> Result<String, FabricError> {
    super::verbs::resolve_smoke_test(ip)
}

#[cfg(not(feature = "rdma"))]
fn resolve(_: IpAddr) -> Result<String, FabricError> {
    Err(FabricError::NoVerbs)
}

/// Chooses the interface (the configured one, else preferably one under an
/// ACTIVE port), then the device with an ACTIVE port (preferring the one
/// bound to that interface), then smoke-tests address resolution.
fn decide(
    devices: Vec<DeviceInfo>,
    ifaces: &[Iface],
    configured: &str,
    resolve: impl Fn(IpAddr) -> Result<String, FabricError>,
) -> Found {
    let mut found = Found::none("");
    if devices.is_empty() {
        found.reason = "no RDMA: no verbs devices on this host".into();
        return found;
    }
    found.devices = devices;
    // Unconfigured, an interface under an active RDMA port comes first: a
    // host also on a network without RDMA (a management or NAT interface)
    // must not pick that one.
    let on_rdma: Vec<Iface> = ifaces
        .iter()
        .filter(|i| {
            found.devices.iter().any(|d| {
                d.ports
                    .iter()
                    .any(|p| p.active && p.netdev.as_deref() == Some(i.name.as_str()))
            })
        })
        .cloned()
        .collect();
    let chosen = match configured {
        "" => select::choose(&on_rdma, "", None).or_else(|| select::choose(ifaces, "", None)),
        _ => select::choose(ifaces, configured, None),
    };
    let Some(iface) = chosen else {
        found.reason = if configured.is_empty() {
            "no RDMA: no usable interface (only loopback, link-local or virtual ones)".into()
        } else {
            format!("no RDMA: transport.interface {configured:?} has no address here")
        };
        return found;
    };
    let active = |d: &&DeviceInfo| d.ports.iter().any(|p| p.active);
    let bound = |d: &&DeviceInfo| {
        d.ports
            .iter()
            .any(|p| p.active && p.netdev.as_deref() == Some(iface.name.as_str()))
    };
    let Some(dev) = found
        .devices
        .iter()
        .find(bound)
        .or_else(|| found.devices.iter().find(active))
        .cloned()
    else {
        found.reason = "no RDMA: no device has an ACTIVE port".into();
        return found;
    };
    found.interface = Some(iface.name.clone());
    found.local_addr = Some(iface.ip);
    let device = match resolve(iface.ip) {
        Ok(name) => name,
        Err(e) => {
            found.reason = format!(
                "no RDMA: rdma_cm cannot resolve {} ({}) to a device: {e}",
                iface.ip, iface.name
            );
            return found;
        }
    };
    found.soft = is_soft(&device);
    let port = dev.ports.iter().find(|p| p.active).expect("active port");
    let caps = if found.soft {
        " (soft device: runtime caps chunk ≤ 32 MiB, pipeline ≤ 64, signal ≤ 64)"
    } else {
        ""
    };
    found.reason = format!(
        "{device} port {} is ACTIVE and {} ({}) resolves to it{caps}",
        port.port, iface.ip, iface.name
    );
    found.available = true;
    found.device = Some(device);
    found
}

/// Why the host's RDMA devices cannot be listed.
#[derive(Debug, thiserror::Error)]
enum NoDevices {
    #[cfg(not(feature = "rdma"))]
    #[error("no RDMA: kvsync was built without the `rdma` feature")]
    NotBuilt,
    #[cfg(feature = "rdma")]
    #[error("no RDMA: the kernel has no RDMA support (ibv_get_device_list: ENOSYS)")]
    NoKernelSupport,
    #[cfg(feature = "rdma")]
    #[error("no RDMA: ibv_get_device_list failed: {0}")]
    Listing(std::io::Error),
}

#[cfg(not(feature = "rdma"))]
fn list_devices() -> Result<Vec<DeviceInfo>, NoDevices> {
    Err(NoDevices::NotBuilt)
}

#[cfg(feature = "rdma")]
fn list_devices() -> Result<Vec<DeviceInfo>, NoDevices> {
    use rdma_sys::*;
    use std::ffi::CStr;

    let mut n: i32 = 0;
    // SAFETY: plain libibverbs calls; every pointer is checked before use and
    // the list and contexts are freed on every path.
    unsafe {
        let list = ibv_get_device_list(&mut n);
        if list.is_null() {
            let err = std::io::Error::last_os_error();
            return Err(if err.raw_os_error() == Some(libc::ENOSYS) {
                NoDevices::NoKernelSupport
            } else {
                NoDevices::Listing(err)
            });
        }
        let mut devices = Vec::new();
        for i in 0..n.max(0) as usize {
            let dev = *list.add(i);
            let name = CStr::from_ptr(ibv_get_device_name(dev))
                .to_string_lossy()
                .into_owned();
            let mut ports = Vec::new();
            let ctx = ibv_open_device(dev);
            if !ctx.is_null() {
                let mut attr = std::mem::zeroed::<ibv_device_attr>();
                if ibv_query_device(ctx, &mut attr) == 0 {
                    for port in 1..=attr.phys_port_cnt {
                        let mut pa = std::mem::zeroed::<ibv_port_attr>();
                        if ___ibv_query_port(ctx, port, &mut pa) == 0 {
                            ports.push(PortInfo {
                                port,
                                state: port_state(pa.state).into(),
                                active: pa.state == ibv_port_state::IBV_PORT_ACTIVE,
                                // IBV_LINK_LAYER_* (an anonymous enum in verbs.h).
                                link_layer: match pa.link_layer {
                                    1 => "InfiniBand",
                                    2 => "Ethernet",
                                    _ => "unspecified",
                                }
                                .into(),
                                netdev: port_netdev(&name, port),
                            });
                        }
                    }
                }
                ibv_close_device(ctx);
            }
            devices.push(DeviceInfo {
                soft: is_soft(&name),
                name,
                ports,
            });
        }
        ibv_free_device_list(list);
        Ok(devices)
    }
}

/// The network device of a port, from sysfs (set for RoCE ports).
#[cfg(feature = "rdma")]
fn port_netdev(device: &str, port: u8) -> Option<String> {
    let dir = format!("/sys/class/infiniband/{device}/ports/{port}/gid_attrs/ndevs");
    (0..4).find_map(|i| {
        std::fs::read_to_string(format!("{dir}/{i}"))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    })
}

#[cfg(feature = "rdma")]
fn port_state(s: rdma_sys::ibv_port_state::Type) -> &'static str {
    use rdma_sys::ibv_port_state::*;
    match s {
        IBV_PORT_DOWN => "DOWN",
        IBV_PORT_INIT => "INIT",
        IBV_PORT_ARMED => "ARMED",
        IBV_PORT_ACTIVE => "ACTIVE",
        IBV_PORT_ACTIVE_DEFER => "ACTIVE_DEFER",
        _ => "NOP",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_device_makes_rdma_unavailable_until_it_is_back() {
        let t = TransportConfig {
            rdma_provider: RdmaProvider::Emulated,
            ..TransportConfig::default()
        };
        let local = LocalRdma::new(probe(&t));
        assert!(local.available());
        local.set_lost(Some("no RDMA: rxe0 was removed".into()));
        assert_eq!(
            (local.available(), local.reason().as_str()),
            (false, "no RDMA: rxe0 was removed")
        );
        assert!(local.probe().rdma_available, "the start-time finding stays");
        local.set_lost(None);
        assert!(local.available());
        assert_eq!(local.reason(), local.probe().reason);
    }

    fn dev(name: &str, states: &[bool], netdev: &str) -> DeviceInfo {
        DeviceInfo {
            name: name.into(),
            soft: is_soft(name),
            ports: states
                .iter()
                .enumerate()
                .map(|(i, &active)| PortInfo {
                    port: i as u8 + 1,
                    state: if active { "ACTIVE" } else { "DOWN" }.into(),
                    active,
                    link_layer: "Ethernet".into(),
                    netdev: Some(netdev.into()),
                })
                .collect(),
        }
    }

    fn ifaces() -> Vec<Iface> {
        vec![
            Iface {
                name: "lo".into(),
                ip: "127.0.0.1".parse().unwrap(),
                prefix: 8,
            },
            Iface {
                name: "eth0".into(),
                ip: "10.0.2.15".parse().unwrap(),
                prefix: 24,
            },
            Iface {
                name: "eth1".into(),
                ip: "10.0.3.15".parse().unwrap(),
                prefix: 24,
            },
        ]
    }

    /// Address resolution that binds whichever device `bound` names.
    fn resolves_to(bound: &'static str) -> impl Fn(IpAddr) -> Result<String, FabricError> {
        move |_| Ok(bound.to_string())
    }

    #[test]
    fn soft_devices_are_recognised() {
        assert!(is_soft("rxe0") && is_soft("siw_eth0"));
        assert!(!is_soft("mlx5_0"));
    }

    #[test]
    fn the_device_of_the_chosen_interface_is_preferred() {
        let devs = vec![
            dev("mlx5_0", &[true], "eth1"),
            dev("rxe0", &[false, true], "eth0"),
        ];
        let f = decide(devs, &ifaces(), "", resolves_to("rxe0"));
        assert!(f.available, "{}", f.reason);
        assert_eq!(f.device.as_deref(), Some("rxe0"));
        assert_eq!(f.interface.as_deref(), Some("eth0"));
        assert!(f.soft);
        assert!(
            f.reason.contains("rxe0 port 2 is ACTIVE") && f.reason.contains("soft device"),
            "{}",
            f.reason
        );
        // Configured eth1: the device bound to it.
        let devs = vec![dev("rxe0", &[true], "eth0"), dev("mlx5_0", &[true], "eth1")];
        let f = decide(devs, &ifaces(), "eth1", resolves_to("mlx5_0"));
        assert_eq!((f.device.as_deref(), f.soft), (Some("mlx5_0"), false));
        assert_eq!(f.local_addr, Some("10.0.3.15".parse().unwrap()));
    }

    #[test]
    fn an_interface_under_an_active_port_is_preferred() {
        // eth0 comes first but carries no RDMA (a NAT or management link).
        let f = decide(
            vec![dev("rxe0", &[true], "eth1")],
            &ifaces(),
            "",
            resolves_to("rxe0"),
        );
        assert!(f.available, "{}", f.reason);
        assert_eq!(f.interface.as_deref(), Some("eth1"));
        assert_eq!(f.local_addr, Some("10.0.3.15".parse().unwrap()));
        // A port that is down does not draw the choice.
        let f = decide(
            vec![dev("rxe0", &[false], "eth1"), dev("rxe1", &[true], "ib0")],
            &ifaces(),
            "",
            resolves_to("rxe1"),
        );
        assert_eq!(f.interface.as_deref(), Some("eth0"));
    }

    #[test]
    fn no_rdma_reasons() {
        let f = decide(
            vec![dev("mlx5_0", &[false], "eth0")],
            &ifaces(),
            "",
            resolves_to("mlx5_0"),
        );
        assert!(
            !f.available && f.reason.contains("no device has an ACTIVE port"),
            "{}",
            f.reason
        );
        assert!(decide(vec![], &ifaces(), "", resolves_to("x"))
            .reason
            .starts_with("no RDMA"));
        let lo_only = &ifaces()[..1];
        let f = decide(
            vec![dev("rxe0", &[true], "eth0")],
            lo_only,
            "",
            resolves_to("rxe0"),
        );
        assert!(f.reason.contains("no usable interface"), "{}", f.reason);
        let f = decide(vec![dev("rxe0", &[true], "eth0")], &ifaces(), "", |_| {
            Err(FabricError::DeviceRemoved)
        });
        assert!(
            !f.available && f.reason.contains("cannot resolve 10.0.2.15"),
            "{}",
            f.reason
        );
    }

    #[test]
    fn soft_caps_apply_to_the_bulk_parameters() {
        let t = TransportConfig {
            chunk_mb: 32,
            pipeline: 1024,
            signal_batch: 512,
            ..Default::default()
        };
        let p = Probe::bulk_params(&t, true);
        assert_eq!((p.chunk >> 20, p.pipeline, p.signal_batch), (32, 64, 64));
        assert_eq!(Probe::bulk_params(&t, false).pipeline, 1024);
    }

    #[test]
    fn this_build_host_has_no_rdma_and_auto_picks_tcp() {
        // The build machines have no RDMA NIC and no kernel RDMA stack; the
        // probe must say so cleanly rather than fail. (Inside the soft-RoCE VM
        // the same binary finds rxe0: see tests/rxe_vm.rs.)
        if std::path::Path::new("/sys/class/infiniband").exists() {
            return;
        }
        let p = probe(&TransportConfig::default());
        assert!(!p.rdma_available);
        assert_eq!(p.choice, TransportKind::Tcp);
        assert!(p.reason.starts_with("no RDMA"), "{}", p.reason);
    }

    #[test]
    fn emulated_provider_says_it_is_an_emulation() {
        let t = TransportConfig {
            rdma_provider: RdmaProvider::Emulated,
            ..Default::default()
        };
        let p = probe(&t);
        assert!(p.rdma_available && p.choice == TransportKind::Rdma);
        assert!(p.reason.contains("emulat"), "{}", p.reason);
        let t = TransportConfig {
            mode: TransportMode::Tcp,
            ..t
        };
        assert_eq!(probe(&t).choice, TransportKind::Tcp);
    }
}
