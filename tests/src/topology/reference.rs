//! The reference plugins a simulated host may run instead of cnibpf, for comparisons: Debian's
//! or Debian unstable's, on iptables or on their own nftables backends.

use serde_json::json;

use super::{Chained, SimHost, cni_path};

/// Which reference plugins a simulated host runs, and so which netfilter they write: Debian's
/// (1.1.1: iptables) or Debian unstable's (≥ 1.5, unpacked by `scripts/bootstrap.sh`) with
/// their own nftables backends (`portmap`'s `backend`, the bridge's `ipMasqBackend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReferencePlugins {
    Iptables,
    Nftables,
}

impl ReferencePlugins {
    /// How benchmarks and comparisons name the reference plugins' netfilter.
    pub fn name(self) -> &'static str {
        match self {
            Self::Iptables => "iptables",
            Self::Nftables => "nftables",
        }
    }

    /// CNI_PATH with these reference plugins first and the cnibpf under test.
    pub(super) fn cni_path(self) -> String {
        match self {
            Self::Iptables => cni_path(),
            Self::Nftables => {
                let unstable = crate::tools_dir().join("cni-plugins-unstable/usr/lib/cni");
                assert!(
                    unstable.join("portmap").exists(),
                    "{}: Debian unstable's plugins are missing (scripts/bootstrap.sh unpacks them)",
                    unstable.display()
                );
                format!("{}:{}", unstable.display(), cni_path())
            }
        }
    }
}

impl SimHost {
    /// A simulated host whose conflist chains Debian's reference `portmap` (iptables) after
    /// the bridge instead of cnibpf, for comparisons.
    pub fn with_reference_portmap(id: &str) -> Self {
        Self::with_reference_portmap_on(ReferencePlugins::Iptables, id)
    }

    /// [`Self::with_reference_portmap`] with `plugins`' portmap on its own netfilter backend.
    pub fn with_reference_portmap_on(plugins: ReferencePlugins, id: &str) -> Self {
        Self::with_reference_portmap_of(plugins, id, None)
    }

    /// A simulated host whose bridge masquerades on `plugins`' own netfilter backend and whose
    /// conflist chains that release's portmap on the same backend: the reference's pod with
    /// hostPorts and masquerade.
    pub fn with_reference_portmap_and_masquerade_on(plugins: ReferencePlugins, id: &str) -> Self {
        Self::with_reference_portmap_of(plugins, id, Some(plugins))
    }

    /// `plugins`' portmap on its own netfilter backend, chained after a bridge that
    /// masquerades on `bridge_masquerades`' (or not at all).
    fn with_reference_portmap_of(
        plugins: ReferencePlugins,
        id: &str,
        bridge_masquerades: Option<ReferencePlugins>,
    ) -> Self {
        let keys = match plugins {
            ReferencePlugins::Iptables => json!({}),
            ReferencePlugins::Nftables => json!({ "backend": "nftables" }),
        };
        Self::build_with(
            id,
            "1.0.0",
            vec![Chained::ReferencePortmap(keys)],
            bridge_masquerades,
            plugins,
        )
    }

    /// A simulated host whose bridge masquerades with iptables (the reference `ipMasq`) and
    /// that chains nothing after it, for comparisons.
    pub fn with_reference_masquerade(id: &str) -> Self {
        Self::with_reference_masquerade_on(ReferencePlugins::Iptables, id)
    }

    /// [`Self::with_reference_masquerade`] with `plugins`' bridge masquerading on its own
    /// netfilter backend (`ipMasqBackend`).
    pub fn with_reference_masquerade_on(plugins: ReferencePlugins, id: &str) -> Self {
        Self::build_with(id, "1.0.0", Vec::new(), Some(plugins), plugins)
    }
}
