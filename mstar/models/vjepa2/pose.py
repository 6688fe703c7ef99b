"""Pose integration of the DROID-style robot state V-JEPA 2-AC predicts with: xyz, extrinsic x-y-z Euler
angles, gripper (7 values), moved by an action delta as the reference's MPC utilities do."""

from __future__ import annotations

import torch

__all__ = ["compute_new_pose", "euler_xyz_to_matrix", "matrix_to_euler_xyz"]


def euler_xyz_to_matrix(angles: torch.Tensor) -> torch.Tensor:
    """[..., 3] extrinsic x-y-z Euler angles -> [..., 3, 3] rotation matrices (R = Rz Ry Rx)."""
    a, b, c = angles.unbind(-1)
    ca, sa, cb, sb, cc, sc = a.cos(), a.sin(), b.cos(), b.sin(), c.cos(), c.sin()
    row0 = torch.stack([cc * cb, cc * sb * sa - sc * ca, cc * sb * ca + sc * sa], -1)
    row1 = torch.stack([sc * cb, sc * sb * sa + cc * ca, sc * sb * ca - cc * sa], -1)
    row2 = torch.stack([-sb, cb * sa, cb * ca], -1)
    return torch.stack([row0, row1, row2], -2)


def matrix_to_euler_xyz(m: torch.Tensor) -> torch.Tensor:
    """Inverse of ``euler_xyz_to_matrix`` (away from gimbal lock)."""
    b = -torch.asin(m[..., 2, 0].clamp(-1.0, 1.0))
    a = torch.atan2(m[..., 2, 1], m[..., 2, 2])
    c = torch.atan2(m[..., 1, 0], m[..., 0, 0])
    return torch.stack([a, b, c], -1)


def compute_new_pose(pose: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """[..., 7] pose + [..., 7] action delta -> new pose, as the reference's MPC utilities: xyz add,
    rotation composed as R(delta) @ R(pose), gripper added and clipped to [0, 1]."""
    xyz = pose[..., :3] + action[..., :3]
    rot = matrix_to_euler_xyz(euler_xyz_to_matrix(action[..., 3:6]) @ euler_xyz_to_matrix(pose[..., 3:6]))
    grip = (pose[..., 6:] + action[..., 6:]).clamp(0.0, 1.0)
    return torch.cat([xyz, rot, grip], -1)
